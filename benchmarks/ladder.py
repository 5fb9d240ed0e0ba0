"""The scaling ladder's prediction against the loss the target run reaches: tiny at several seeds, and smoke.

Run: `python benchmarks/ladder.py [--seeds 1234 1 2] [--presets tiny smoke] [--store DIR]`.

Each (preset, seed) is one `moeflow run CONFIG --until train` (`--until evaluate` for an additive ladder) of
the preset with `seed` replaced (smoke gets the ladder of `SMOKE_LADDER`: the preset has none), against the
store of `--store` (default: the usual one, so the data stages, keyed without the run's seed, are reused across
seeds; the mix, rungs, ladder and target are the seed's own). From the run's record it reads the ladder's
pre-registered `prediction.json` and what it predicted: for the additive fit (tiny's) the held-out loss
averaged over domains (evaluate's), else the train stage's `tail_loss` (the mean training cross-entropy of the
last tenth of the steps). Per run: predicted, band, actual, relative error (actual - predicted) / actual,
inside the band, the ladder's FLOPs as a share of the target's, and (additive) whether the short rungs ended
while the target's shape still pulled ahead of the narrow one (`lead_still_rising`: the fit's own warning). The
last line is one JSON object with `runs` and the headline keys `max_abs_error` (the largest |relative error|),
`all_inside_band` and `flops_share` (the largest), and `tiny_seed_spread`: (max - min) / mean of the tiny
seeds' actual losses, how far the target's own loss moves with the seed alone. What it does not show: any
corpus but the presets' own (issue 35 checks others too), or the ladder's wall time (the rungs' FLOPs are what
the budget counts).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import yaml
from _runs import run_until  # benchmarks/_runs.py: not a benchmark (scripts run from benchmarks/)

from moeflow import configs

SMOKE_LADDER = {"fit": "additive", "widths": [16], "layers": [1], "budget_fraction": 0.3, "min_steps": 3}


def run_once(preset: str, seed: int, store: str | None, work: Path) -> dict:
    data = yaml.safe_load(configs.resolve(preset).read_text())
    data["seed"] = seed
    if preset == "smoke" and not data.get("ladder"):
        data["ladder"] = SMOKE_LADDER
    if store:
        data["store"] = store
    additive = data["ladder"].get("fit") == "additive"
    root, stages = run_until(data, f"{preset}-{seed}", "evaluate" if additive else "train", work)
    pred = json.loads((root / "ladder" / f"ladder-{stages['ladder']['hash']}" / "prediction.json").read_text())
    if additive:  # the held-out loss averaged over domains, on the target's rows that scored the rungs
        held = _stats(root, "evaluate", stages)["heldout"]
        actual = round(sum(r["loss"] for r in held.values()) / len(held), 4)
        predicted, (lo, hi) = pred["predicted_heldout_loss"], pred["heldout_band"]
    else:
        actual = _stats(root, "train", stages)["tail_loss"]
        predicted, (lo, hi) = pred["predicted_final_loss"], pred["band"]
    return {
        "preset": preset,
        "seed": seed,
        "loss": "held-out" if additive else "final training",
        "predicted": predicted,
        "band": [lo, hi],
        "actual": actual,
        "relative_error": round((actual - predicted) / actual, 4),
        "inside_band": lo <= actual <= hi,
        "flops_share": round(pred["ladder_fraction"], 4),
        # the additive fit's warning (moe/ladder.py `lead_peak`): the short rungs ended while the target's shape
        # still pulled ahead of the narrow one, so the ends need not bracket the target
        "lead_still_rising": pred["fit"].get("lead", {}).get("still_rising"),
        "rungs": [[r["d_model"], r["n_layers"], r["steps"], r["final_loss"], r.get("heldout_loss")]
                  for r in pred["rungs"]],
    }


def _stats(root: Path, stage: str, stages: dict) -> dict:
    return json.loads((root / stage / f"{stage}-{stages[stage]['hash']}" / "lineage.json").read_text())["stats"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2], help="tiny's seeds")
    p.add_argument("--presets", nargs="+", default=["tiny", "smoke"], help="smoke runs at its own seed only")
    p.add_argument("--store", default=None, help="artifact store (default: the config's own)")
    args = p.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as work:
        for preset in args.presets:
            for seed in args.seeds if preset == "tiny" else [configs.load(preset).seed]:
                r = run_once(preset, seed, args.store, Path(work))
                print(f"{preset} seed {seed}: predicted {r['predicted']} (band {r['band'][0]} to {r['band'][1]}), "
                      f"actual {r['actual']}, error {r['relative_error']:+.2%}, "
                      f"{'inside' if r['inside_band'] else 'outside'} the band, ladder {r['flops_share']:.1%} "
                      f"of the target's FLOPs{', lead still rising' if r['lead_still_rising'] else ''}", flush=True)
                runs.append(r)
    tiny = [r["actual"] for r in runs if r["preset"] == "tiny"]
    print(json.dumps({
        "runs": runs,
        "max_abs_error": max(abs(r["relative_error"]) for r in runs),
        "all_inside_band": all(r["inside_band"] for r in runs),
        "flops_share": max(r["flops_share"] for r in runs),
        # how far the target's own loss moves with the seed: (max - min) / mean of tiny's actuals
        "tiny_seed_spread": round((max(tiny) - min(tiny)) / (sum(tiny) / len(tiny)), 4) if len(tiny) > 1 else None,
    }))


if __name__ == "__main__":
    main()
