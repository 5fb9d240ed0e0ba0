"""The mixture search against the declared and a uniform mix: the same target trained on each, per seed.

Run: `python benchmarks/mix_search.py [--preset tiny] [--seeds 1234 1 2] [--proxies K] [--store DIR] [--nudge 0.01]
[--mixes W,W,W ... [--width W --layers L] [--batch B] [--lr LR] [--classes C]]`. With `--mixes` (weights in the
order of the preset's `mix.weights`), no search runs: the target trains on each given mix instead (every phase
tilted as the search's chosen mix would be), the ground truth a search is judged against; with `--width`/
`--layers`/`--batch`/`--lr`/`--classes`, a proxy of that shape, batch, peak learning rate and output classes does
(benchmark items off: only the held-out losses are read).

Per seed, three `moeflow run CONFIG --until evaluate` runs of the preset (its ladder off: it does not change the
target) with `seed` replaced: with `mix.search` (the target trains on the searched mix), on the declared weights,
and on uniform weights (every phase's too). All three train the same model for the same steps. The objective of
each is `mix.search.objective` (default: the held-out loss averaged over domains) on the target's own evaluate
stage. The held-out rows are the same for all three, because the held-out split does not depend on the weights.
From the search: the proxies' FLOPs share and the fit's leave-one-out rank correlation. The last line is one
JSON object: `runs`, and the headline keys `beats_declared_all_seeds`, `beats_uniform_all_seeds`,
`proxy_flops_share` (the largest) and `heldout_rank_correlation` (the smallest). Beside them, what decides whether
a win means anything: `predicted_gain` (the smallest gain the proxies' fit expects of the chosen mix over the
declared or the uniform one, at the proxies' scale; each run has both, and the fit's leave-one-out error on the
objective) and `paired_noise` (the largest, over seeds, of how far the target moves when 0.01 of the declared
weight goes from its largest domain to its smallest: `--nudge`, one more target a seed). What it does not show:
corpora other than the preset's, or objectives other than the default; one nudge a seed samples the noise once.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import yaml
from _runs import run_until  # benchmarks/_runs.py: not a benchmark (scripts run from benchmarks/)

from moeflow import configs
from moeflow.configs.data import tilt
from moeflow.moe import ladder, mix_search


def run_config(data: dict, name: str, work: Path) -> dict:
    """Run `data` until evaluate; the stages of its run record as {label: lineage}."""
    _, stages = run_until(data, name, "evaluate", work)
    return {k: json.loads((Path(v["artifact"]) / "lineage.json").read_text()) for k, v in stages.items()}


def uniform(mix: dict) -> dict:
    domains = [d for d, w in mix["weights"].items() if w > 0]
    even = {d: 1 / len(domains) for d in domains}
    phases = [{**p, "weights": even} if p.get("weights") else p for p in mix.get("phases", [])]
    return {**mix, "weights": even, "phases": phases}


def tilted(mix: dict, weights: list[float]) -> dict:
    """The preset's mix on `weights` (in its domains' order), each phase tilted as `MixConfig.tilted` does."""
    new = dict(zip(mix["weights"], weights, strict=True))
    phases = [{**p, "weights": tilt(p["weights"], mix["weights"], new)} if p.get("weights") else p
              for p in mix.get("phases", [])]
    return {**mix, "weights": new, "phases": phases}


def proxy(base: dict, width: int | None, layers: int, batch: int | None, lr: float | None = None,
          classes: int | None = None) -> dict:
    """`base` at a proxy's `width` x `layers` (the ladder's scaling of the recipe), `batch`, `lr` and output
    classes, benchmarks off."""
    if not (width or batch or lr or classes):
        return base
    base = {**base, "evaluate": {**(base.get("evaluate") or {}), "benchmark_items": 0}}
    if width:
        model = ladder._model(configs.ModelConfig(**base["model"]), width, layers)
        base["model"] = model.model_dump(mode="json", exclude_defaults=True)
    if batch:
        base["train"] = {**base["train"], "batch_size": batch}
    if lr:
        base["train"] = {**base["train"], "lr": lr}
    if classes:
        base["model"] = {**base["model"], "output_classes": classes}
    return base


def grid(base: dict, seed: int, mixes: list[list[float]], work: Path) -> list[dict]:
    """The target on each of `mixes` at `seed`: each one's held-out loss per domain and their mean."""
    out = []
    for w in mixes:
        lin = run_config({**base, "seed": seed, "ladder": None, "mix": tilted(base["mix"], w)},
                         f"grid-{seed}-{'_'.join(map(str, w))}", work)
        heldout = {d: r["loss"] for d, r in lin["evaluate"]["stats"]["heldout"].items()}
        out.append({"seed": seed, "weights": dict(zip(base["mix"]["weights"], w)), "heldout": heldout,
                    "objective": round(sum(heldout.values()) / len(heldout), 4)})
        print(json.dumps(out[-1]), flush=True)
    return out


def nudged(weights: list[float], by: float) -> list[float]:
    """`weights` with `by` moved from the largest to the smallest other: a mix no search could tell from them."""
    out = list(weights)
    hi = out.index(max(out))
    lo = min((i for i in range(len(out)) if i != hi), key=out.__getitem__)  # even weights: another domain
    out[hi], out[lo] = out[hi] - by, out[lo] + by
    return [round(w, 6) for w in out]


def predicted(s: dict, mix: dict[str, float], search: configs.MixSearchConfig) -> float:
    """The search's fit (its lineage record `s`) on `mix`: its predicted objective, at the proxies' scale."""
    law = {d: [v["c"], *(v["b"][j] for j in s["law"])] for d, v in s["law"].items()}
    return search.reduce(mix_search.predict(law, [mix])[0])


def one_seed(base: dict, seed: int, proxies: int | None, nudge: float, work: Path) -> dict:
    base = {**base, "seed": seed, "ladder": None}
    search = configs.MixSearchConfig(**({"proxies": proxies} if proxies else {}))
    runs = {"searched": run_config({**base, "mix": {**base["mix"], "search": search.model_dump(mode="json")}},
                                   f"search-{seed}", work),
            "declared": run_config(base, f"declared-{seed}", work),
            "uniform": run_config({**base, "mix": uniform(base["mix"])}, f"uniform-{seed}", work)}
    if nudge:
        near = tilted(base["mix"], nudged(list(base["mix"]["weights"].values()), nudge))
        runs["nudged"] = run_config({**base, "mix": near}, f"nudged-{seed}", work)
    objective = {name: search.reduce({d: r["loss"] for d, r in lin["evaluate"]["stats"]["heldout"].items()})
                 for name, lin in runs.items()}
    s = runs["searched"]["mix_search"]["stats"]
    even = {d: 1 / len(s["law"]) for d in s["law"]}  # the fit tilts phases; the uniform run flattens them
    out = {"seed": seed, **{k: round(v, 4) for k, v in objective.items()},
           "chosen": s["weights"], "declared_weights": s["declared"],
           "predicted_objective": round(s["predicted_objective"], 4),
           # the gain the proxies' fit expects of the chosen mix, beside its leave-one-out error on the objective
           "predicted_gain_over_declared": round(s["predicted_gain"], 4),
           "predicted_gain_over_uniform": round(predicted(s, even, search) - s["predicted_objective"], 4),
           "loo_objective_rmse": round(s["loo_objective_rmse"], 4),
           "proxy_flops_share": round(s["proxy_fraction"], 4),
           "heldout_rank_correlation": round(s["loo_rank_correlation"], 4)}
    if nudge:  # what the target's loss moves by between two mixes the search cannot tell apart
        out["paired_noise"] = round(abs(objective["nudged"] - objective["declared"]), 4)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    p.add_argument("--proxies", type=int, default=None, help="proxies (default: mix.search's default)")
    p.add_argument("--store", default=None, help="artifact store (default: the config's own)")
    p.add_argument("--nudge", type=float, default=0.01,
                   help="also train the target on the declared mix with this much weight moved from its largest "
                        "domain to its smallest, the paired noise floor (0: not)")
    p.add_argument("--mixes", nargs="+", default=None, help="train the target on these mixes (W,W,W), no search")
    p.add_argument("--width", type=int, default=None, help="with --mixes: a proxy of this d_model")
    p.add_argument("--layers", type=int, default=1, help="with --width: its layers")
    p.add_argument("--batch", type=int, default=None, help="with --mixes: this batch size")
    p.add_argument("--lr", type=float, default=None, help="with --mixes: this peak learning rate")
    p.add_argument("--classes", type=int, default=None, help="with --mixes: an LM head over this many token classes")
    args = p.parse_args()
    base = yaml.safe_load(configs.resolve(args.preset).read_text())
    if args.store:
        base["store"] = args.store
    runs = []
    with tempfile.TemporaryDirectory() as work:
        if args.mixes:
            mixes = [[float(x) for x in m.split(",")] for m in args.mixes]
            shaped = proxy(base, args.width, args.layers, args.batch, args.lr, args.classes)
            runs = [r for seed in args.seeds for r in grid(shaped, seed, mixes, Path(work))]
            print(json.dumps({"preset": args.preset, "grid": runs}))
            return
        for seed in args.seeds:
            r = one_seed(base, seed, args.proxies, args.nudge, Path(work))
            print(f"seed {seed}: searched {r['searched']}, declared {r['declared']}, uniform {r['uniform']} "
                  f"(proxies {r['proxy_flops_share']:.1%} of the target's FLOPs, leave-one-out rank correlation "
                  f"{r['heldout_rank_correlation']}); chosen {r['chosen']}", flush=True)
            runs.append(r)
    print(json.dumps({
        "preset": args.preset, "runs": runs,
        "beats_declared_all_seeds": all(r["searched"] < r["declared"] for r in runs),
        "beats_uniform_all_seeds": all(r["searched"] < r["uniform"] for r in runs),
        "proxy_flops_share": max(r["proxy_flops_share"] for r in runs),
        "heldout_rank_correlation": min(r["heldout_rank_correlation"] for r in runs),
        "predicted_gain": min(min(r["predicted_gain_over_declared"], r["predicted_gain_over_uniform"]) for r in runs),
        **({"paired_noise": max(r["paired_noise"] for r in runs)} if args.nudge else {}),
    }))


if __name__ == "__main__":
    main()
