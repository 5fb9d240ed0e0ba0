"""Scaling ladder: small runs of the target's recipe, a fit, a pre-registered prediction.

Two fits (`ladder.fit`). `compute` (below): every width's final training loss against FLOPs. `additive`: the
held-out loss from three rungs: the first width at the target's steps, and the first width and the target's
own shape at a few steps, as many as the budget leaves; the prediction keeps the target's shape's gain at the
few steps whole (Chinchilla's separable L(N, D) = g(N) + h(D)), and the band spans that gain doubled and washed
out (`additive`).

Rungs keep the target's recipe: the same mix (a prefix of its sequences), tokenizer, batch, sequence
length and schedule shape, and the same MoE shape ratios (expert width / d_model, head width, experts,
top-k). Each rung's token budget is proportional to its active parameters, scaled so the ladder
costs `budget_fraction` of the target's training FLOPs (at least `min_steps` steps each).
The fit is L(C) = E + A * (C / C_target)^(-alpha) with `scipy.optimize.curve_fit`; its band comes
from refitting on bootstrap resamples of the rungs. "Final loss" is the same everywhere: the mean
training cross-entropy of the last tenth of the steps (at least 3).
During the target run, the band for each step is the ladder's loss curves, each divided by its own
final loss (so: as a function of the fraction of training done), times the predicted final loss.
"""

from __future__ import annotations

import json
import warnings
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from scipy.optimize import curve_fit

from moeflow.configs import ConfigError, LadderConfig, ModelConfig, RunConfig, TrainConfig
from moeflow.moe import device, evaluate
from moeflow.moe.model import Transformer
from moeflow.tokenize import tokenizer

SMOOTH = 10  # steps in the moving average that curves are compared on


def tail_loss(losses: list[float]) -> float:
    k = max(3, len(losses) // 10)
    return float(np.mean(losses[-k:]))


def smooth(losses: list[float]) -> np.ndarray:
    x = np.asarray(losses, dtype=float)
    c = np.concatenate([[0.0], np.cumsum(x)])
    i = np.arange(1, len(x) + 1)
    lo = np.maximum(0, i - SMOOTH)
    return (c[i] - c[lo]) / (i - lo)


def _model(cfg: ModelConfig, width: int, layers: int) -> ModelConfig:
    head = cfg.d_model // cfg.n_heads
    if width % head or width < head:
        raise ValueError(f"ladder width {width} is not a multiple of the target's head width {head}")
    scale = width / cfg.d_model
    return cfg.model_copy(
        update={
            "d_model": width,
            "n_heads": width // head,
            "n_layers": layers,
            "expert_hidden": max(8, round(cfg.expert_hidden * scale / 8) * 8),
            "shared_expert_hidden": round(cfg.shared_expert_hidden * scale / 8) * 8,
            "dense_hidden": round(cfg.dense_hidden * scale / 8) * 8 if cfg.dense_hidden else None,
            "dense_layers": min(cfg.dense_layers, layers),
        }
    )


def flops(
    model: ModelConfig, train: TrainConfig, vocab: int, phases: list[tuple[int, int]] | None = None
) -> tuple[int, int]:
    """(training FLOPs of the run, active parameters) from the model's own FLOPs-per-token estimate;
    `phases`: (steps, seq_len) of each curriculum phase, default one phase at train.seq_len."""
    phases = phases or [(train.steps, train.seq_len)]
    m = Transformer(model, vocab, max(s for _, s in phases))
    return (sum(m.flops_per_token(s) * n * train.batch_size * s for n, s in phases), m.num_params()["active"])


def plan(cfg: RunConfig, vocab: int) -> list[dict]:
    """The rungs: model and train configs, FLOPs and parameters, cheapest first. Their FLOPs stay within
    `budget_fraction` of the target's: where `min_steps` lifts a rung above its share, the others get less;
    a ConfigError where the rungs at `min_steps` alone cost more."""
    lad: LadderConfig = cfg.ladder
    phases = [(p.steps, p.seq_len) for p in cfg.phases()]
    target_flops, _ = flops(cfg.model, cfg.train, vocab, phases)
    if lad.fit == "additive":
        return _plan_additive(cfg, vocab, target_flops)
    layers = lad.layers or (cfg.model.n_layers,) * len(lad.widths)
    models = [_model(cfg.model, w, n) for w, n in zip(lad.widths, layers)]
    longest = max(s for _, s in phases)
    # With a curriculum given in fractions, each rung runs all of it on its own mix (the phases keep their
    # shares of the rung's steps); otherwise a rung trains on a prefix of the target's mix.
    shares = [(n / cfg.train.steps, s) for n, s in phases] if own_curriculum(cfg) else [(1.0, phases[0][1])]
    per_token = []
    for m in models:
        t = Transformer(m, vocab, longest)
        fpt = sum(f * s * t.flops_per_token(s) for f, s in shares) / sum(f * s for f, s in shares)
        per_token.append((fpt, t.num_params()["active"], t))
    # tokens_r = k * N_r, with sum_r fpt_r * k * N_r = fraction * target FLOPs
    budget = lad.budget_fraction * target_flops
    k = budget / sum(f * n for f, n, _ in per_token)
    for _ in range(50):
        rungs = [_rung(cfg, m, t, k * n, vocab, shares) | {"params_active": n}
                 for m, (_, n, t) in zip(models, per_token)]
        spent = sum(r["flops"] for r in rungs)
        if spent <= budget * 1.0001:
            return rungs
        if all(r["train"].steps == lad.min_steps for r in rungs):
            raise ConfigError(
                f"ladder: its {len(rungs)} rungs at ladder.min_steps={lad.min_steps} cost {spent / target_flops:.1%} "
                f"of the target's FLOPs, over ladder.budget_fraction={lad.budget_fraction}: lower min_steps, "
                "give fewer or narrower widths, or raise budget_fraction"
            )
        k *= 0.99 * budget / spent
    raise ConfigError(f"ladder: no rung lengths fit ladder.budget_fraction={lad.budget_fraction}")


def _plan_additive(cfg: RunConfig, vocab: int, target_flops: float) -> list[dict]:
    """The additive fit's rungs: the first width at a few steps, the target's own shape at as many, and the first
    width at the target's steps (the budget left after it sets how few)."""
    lad: LadderConfig = cfg.ladder
    small = _model(cfg.model, lad.widths[0], (lad.layers or (cfg.model.n_layers,))[0])
    if (small.d_model, small.n_layers) == (cfg.model.d_model, cfg.model.n_layers):
        raise ConfigError("ladder.widths[0] (with ladder.layers[0]) is the target's own shape: the additive fit "
                          "needs a smaller one")
    full = _rung_at(cfg, small, cfg.train.steps, vocab)
    left = lad.budget_fraction * target_flops - full["flops"]
    steps = int(cfg.train.steps * left / (full["flops"] + target_flops))  # both rungs' FLOPs grow with their steps
    while steps >= lad.min_steps:
        pair = [_rung_at(cfg, small, steps, vocab), _rung_at(cfg, cfg.model, steps, vocab)]
        if sum(r["flops"] for r in pair) <= left * 1.0001:
            return [r | {"params_active": flops(r["model"], r["train"], vocab)[1]} for r in (*pair, full)]
        steps -= 1
    raise ConfigError(
        f"ladder: width {lad.widths[0]} at the target's {cfg.train.steps} steps costs "
        f"{full['flops'] / target_flops:.1%} of its FLOPs, leaving too little of ladder.budget_fraction="
        f"{lad.budget_fraction} for {lad.min_steps} (ladder.min_steps) steps of it and of the target's shape: "
        "raise budget_fraction, lower min_steps, or give a narrower widths[0]"
    )


def _rung(cfg: RunConfig, m: ModelConfig, t: Transformer, tokens: float, vocab: int, shares: list) -> dict:
    """One rung of `m` for about `tokens` tokens (at least `ladder.min_steps` steps)."""
    phases = [(p.steps, p.seq_len) for p in cfg.phases()]
    if own_curriculum(cfg):
        per_step = cfg.train.batch_size * sum(f * s for f, s in shares)
        steps = max(cfg.ladder.min_steps, round(tokens / per_step))
    else:
        fpt = t.flops_per_token(shares[0][1])
        steps = max(cfg.ladder.min_steps, _steps_for(fpt * tokens, t, cfg.train.batch_size, phases))
    return _rung_at(cfg, m, steps, vocab)


def _rung_at(cfg: RunConfig, m: ModelConfig, steps: int, vocab: int) -> dict:
    """One rung of `m` for `steps` steps of the target's schedule shape."""
    phases = [(p.steps, p.seq_len) for p in cfg.phases()]
    train = cfg.train.model_copy(
        update={
            "steps": steps,
            "warmup_steps": round(cfg.train.warmup_steps * steps / cfg.train.steps),
            "checkpoint_every": steps,
        }
    )
    rung_phases = (
        [(p.steps, p.seq_len) for p in cfg.model_copy(update={"train": train}).phases()]
        if own_curriculum(cfg)
        else _prefix(phases, steps)
    )
    rung_flops, _ = flops(m, train, vocab, rung_phases)
    return {"model": m, "train": train, "flops": rung_flops, "own_mix": own_curriculum(cfg)}


def own_curriculum(cfg: RunConfig) -> bool:
    """Whether rungs run the whole curriculum on their own mixes: two or more phases, none given in tokens
    (with one phase, a prefix of the target's mix is the same curriculum)."""
    return len(cfg.mix.phases) > 1 and all(p.tokens is None for p in cfg.mix.phases)


def _steps_for(budget: float, model: Transformer, batch_size: int, phases: list[tuple[int, int]]) -> int:
    """Steps of `model` along the mix's phases (the last one extended) until `budget` FLOPs are spent."""
    steps = 0
    for i, (n, seq_len) in enumerate(phases):
        per_step = model.flops_per_token(seq_len) * batch_size * seq_len
        take = round(budget / per_step) if i == len(phases) - 1 else min(n, round(budget / per_step))
        steps, budget = steps + take, budget - take * per_step
        if budget <= per_step / 2:
            break
    return steps


def _prefix(phases: list[tuple[int, int]], steps: int) -> list[tuple[int, int]]:
    """The (steps, seq_len) phases of the first `steps` steps of the mix."""
    out, left = [], steps
    for n, seq_len in phases:
        if left <= 0:
            break
        out.append((min(n, left), seq_len))
        left -= out[-1][0]
    return out


def law(x: np.ndarray, e: float, a: float, alpha: float) -> np.ndarray:
    return e + a * np.power(x, -alpha)


def fit(compute: list[float], loss: list[float], target: float, bootstrap: int = 200, seed: int = 0) -> dict:
    """Fit L = E + A (C/target)^-alpha; predict at C = target with a bootstrap 90% band."""
    x = np.asarray(compute, dtype=float) / target
    y = np.asarray(loss, dtype=float)
    p0 = (0.8 * y.min(), max(1e-3, y.max() - 0.8 * y.min()), 0.3)
    bounds = ([0.0, 0.0, 1e-3], [y.min(), np.inf, 3.0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        params, _ = curve_fit(law, x, y, p0=p0, bounds=bounds, maxfev=20000)
        rng = np.random.default_rng(seed)
        preds = []
        for _ in range(bootstrap):
            idx = rng.integers(0, len(x), len(x))
            if len(set(idx.tolist())) < 3:
                continue
            try:
                p, _ = curve_fit(law, x[idx], y[idx], p0=params, bounds=bounds, maxfev=20000)
            except RuntimeError:
                continue
            preds.append(float(law(np.array([1.0]), *p)[0]))
    e, a, alpha = (float(v) for v in params)
    predicted = e + a
    residual = float(np.sqrt(np.mean((law(x, *params) - y) ** 2)))
    lo, hi = np.percentile(preds, [5, 95]).tolist() if len(preds) >= 10 else [predicted, predicted]
    lo, hi = min(lo, predicted - residual), max(hi, predicted + residual)
    return {
        "E": e,
        "A": a,
        "alpha": alpha,
        "predicted": predicted,
        "band": [lo, hi],
        "residual_rms": residual,
        "bootstrap_fits": len(preds),
    }


def stage(s: dict, inputs: dict, out: Path) -> dict:
    """The `ladder` stage's body: `s` holds the ladder, model, train, seed and phases (and, for the additive fit,
    the held-out rows' cap and the device); inputs the rungs, the tokenizer and (additive) the target's mix."""
    rungs = [m.dir for k, m in sorted(inputs.items()) if k.startswith("rung")]
    vocab = tokenizer.load(inputs["tokenizer"].dir).get_vocab_size()
    held = (heldout_losses(rungs, inputs["mix"].dir, s["eval_sequences"], s["device"])
            if s["ladder"].fit == "additive" else None)
    return predict(
        s["ladder"],
        s["model"],
        s["train"],
        s["phases"],
        seed=s["seed"],
        rung_dirs=rungs,
        vocab=vocab,
        out=out,
        heldout=held,
    )


def heldout_losses(rung_dirs: list[Path], mix_dir: Path, cap: int, where: str) -> list[dict[str, np.ndarray]]:
    """Each rung's loss on each of the target's held-out rows that evaluation scores, by domain."""
    dev = device.resolve(where)
    held = evaluate.HeldOut(mix_dir, cap)
    out = []
    for folder in rung_dirs:
        model = evaluate.load_model(folder).to(dev)
        out.append({d: evaluate.row_losses(model, held.data[p], dev) for d, p in held.picked.items()})
    return out


def additive(rows: list[dict], heldout: list[dict[str, np.ndarray]], model: ModelConfig, steps: int,
             bootstrap: int, seed: int) -> dict:
    """The target's loss from the narrow rung's at the target's steps (`full`) and the gain of the target's shape
    over the narrow one at the short steps (`big` - `small`), kept whole at every token count: Chinchilla's
    separable form L(N, D) = g(N) + h(D). How that gain changes from the short steps to the target's, three rungs
    cannot tell, so the band spans it doubled and washed out, each end widened by resampling each domain's
    held-out rows (the same rows for every rung): the 5th percentile of the lower end, the 95th of the upper.
    Measured (issue 35): before the head's unigram bias a narrow rung started late and the gain washed out
    (smoke's was 0.74 at 17 steps, 0.37 at 40); with it, the gain grew 1.25-1.45x from 31 to 300 steps (tiny,
    3 seeds), 1.33-1.57x on other slices of its packages, and 3.2x from 5 to 40 (smoke). On held-out losses
    (the mean over domains); on final training losses for the target run's live band."""
    full, small, big = _roles(rows, model, steps)

    def ends(loss: list[float]) -> tuple[float, float]:
        """(gain doubled, gain washed out): the separable prediction is their middle."""
        return loss[full] + 2 * (loss[big] - loss[small]), loss[full]

    doubled, washed = ends([_domains_mean(h) for h in heldout])
    rng = np.random.default_rng(seed)
    lows, highs = [], []
    for _ in range(bootstrap):
        pick = {d: rng.integers(0, len(v), len(v)) for d, v in heldout[0].items()}
        resampled = ends([_domains_mean({d: h[d][i] for d, i in pick.items()}) for h in heldout])
        lows.append(min(resampled))
        highs.append(max(resampled))
    lo, hi = float(np.percentile(lows, 5)), float(np.percentile(highs, 95))
    widen = (min(doubled, washed) - lo, hi - max(doubled, washed))
    train = ends([r["final_loss"] for r in rows])
    return {"predicted_heldout": (doubled + washed) / 2, "heldout_band": [lo, hi],
            "ends": {"gain_doubled": doubled, "gain_washed_out": washed},
            "predicted": sum(train) / 2, "band": [min(train) - widen[0], max(train) + widen[1]],
            "bootstrap_fits": bootstrap}


def _roles(rows: list[dict], model: ModelConfig, steps: int) -> tuple[int, int, int]:
    """The additive fit's rungs as indices into `rows`: (the narrow one at the target's steps, the narrow one
    at a few, the target's shape at a few)."""
    full = next(i for i, r in enumerate(rows) if r["steps"] == steps)
    big = next(i for i, r in enumerate(rows) if (r["d_model"], r["n_layers"]) == (model.d_model, model.n_layers))
    return full, next(i for i in range(len(rows)) if i not in (full, big)), big


def lead_peak(narrow: list[float], big: list[float]) -> dict:
    """Where the target's shape's lead over the narrow rung peaked in the short rungs: their per-step training
    cross-entropy, narrow minus target shape, averaged over windows of a fifth of the steps (at least 2); the
    step the highest window ends at. A wider model pulls ahead first and the narrow one catches up later (tiny's
    pair at 31 steps: the lead peaked near step 13, then fell); a lead that peaks in the last fifth of the steps
    was still growing when the short rungs ended, so their gain says little about the gain at the target's
    steps and the fit's two ends need not bracket the target (smoke's pair at 5 of 40 steps: the held-out gain
    was 0.36 at 5 steps, 0.74 at 17 and 0.37 at 40)."""
    lead = np.asarray(narrow, dtype=float) - np.asarray(big, dtype=float)
    window = max(2, len(lead) // 5)
    means = np.convolve(lead, np.ones(window) / window, mode="valid")
    peak = int(np.argmax(means)) + window
    return {"steps": len(lead), "peak_step": peak, "still_rising": peak > len(lead) - max(1, len(lead) // 5)}


def _domains_mean(losses: dict[str, np.ndarray]) -> float:
    """The held-out loss averaged over domains (each domain's the mean of its rows'), as the card reads it."""
    return float(np.mean([v.mean() for v in losses.values()]))


def predict(
    lad: LadderConfig,
    model: ModelConfig,
    train: TrainConfig,
    phases: list,
    *,
    seed: int,
    rung_dirs: list[Path],
    vocab: int,
    out: Path,
    heldout: list[dict[str, np.ndarray]] | None = None,
) -> dict:
    """Fit the rungs' losses and write the pre-registered `prediction.json` and `curves.json`. `heldout`: each
    rung's held-out row losses by domain (the additive fit)."""
    target_flops, target_params = flops(model, train, vocab, [(p.steps, p.seq_len) for p in phases])
    rows, curves, losses = _rungs(rung_dirs)
    if lad.fit == "additive":
        for r, h in zip(rows, heldout or [], strict=True):
            r["heldout_loss"] = round(_domains_mean(h), 4)
        result = additive(rows, heldout, model, train.steps, lad.bootstrap, seed)
        _, small, big = _roles(rows, model, train.steps)
        fitted = {"kind": "additive", "bootstrap_fits": result["bootstrap_fits"],
                  **{k: round(v, 4) for k, v in result["ends"].items()},
                  "lead": lead_peak(losses[small], losses[big])}
        held = {"predicted_heldout_loss": round(result["predicted_heldout"], 4),
                "heldout_band": [round(v, 4) for v in result["heldout_band"]]}
    else:
        result = fit([r["flops"] for r in rows], [r["final_loss"] for r in rows], target_flops,
                     bootstrap=lad.bootstrap, seed=seed)
        fitted = {"kind": "compute", **{k: result[k] for k in ("E", "A", "alpha", "residual_rms", "bootstrap_fits")}}
        held = {}
    prediction = {
        "registered_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "target": {"flops": target_flops, "params_active": target_params, "steps": train.steps},
        "ladder_flops": sum(r["flops"] for r in rows),
        "ladder_fraction": sum(r["flops"] for r in rows) / target_flops,
        "fit": fitted,
        "predicted_final_loss": round(result["predicted"], 4),
        "band": [round(v, 4) for v in result["band"]],
        **held,
        "bounds": {
            "peak_grad_norm": max(r["peak_grad_norm"] for r in rows),
            "final_load_imbalance": max(max(r["final_load_imbalance"]) for r in rows),
        },
        "rungs": rows,
    }
    (out / "prediction.json").write_text(json.dumps(prediction, indent=2, sort_keys=True))
    (out / "curves.json").write_text(json.dumps(curves))
    return prediction


def _rungs(rung_dirs: list[Path]) -> tuple[list[dict], list[dict], list[list[float]]]:
    """Each rung's shape, cost, final training loss and health from its lineage and metrics, its loss
    curve as a ratio to its final loss against the fraction of its steps, and its per-step cross-entropy."""
    rows, curves, losses = [], [], []
    for folder in rung_dirs:
        stats = json.loads((folder / "lineage.json").read_text())["stats"]
        ce = [json.loads(line)["ce"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
        final = tail_loss(ce)
        rows.append({**{k: stats[k] for k in ("d_model", "n_layers", "params_active", "steps", "tokens", "flops")},
                     "final_loss": round(final, 4),
                     **{k: stats[k] for k in ("peak_grad_norm", "final_load_imbalance")}})
        s = smooth(ce)
        curves.append({"fraction": (np.arange(1, len(s) + 1) / len(s)).tolist(), "ratio": (s / final).tolist()})
        losses.append(ce)
    return rows, curves, losses


class Band:
    """The expected training-loss band of the target run at each step, from the ladder's curves."""

    def __init__(self, folder: Path, steps: int, tolerance: float):
        pred = json.loads((Path(folder) / "prediction.json").read_text())
        curves = json.loads((Path(folder) / "curves.json").read_text())
        grid = (np.arange(1, steps + 1)) / steps
        ratios = np.array([np.interp(grid, c["fraction"], c["ratio"]) for c in curves])
        lo, hi = pred["band"]
        self.lower = ratios.min(axis=0) * lo * (1 - tolerance)
        self.upper = ratios.max(axis=0) * hi * (1 + tolerance)

    def check(self, step: int, smoothed_loss: float) -> str | None:
        lo, hi = float(self.lower[step - 1]), float(self.upper[step - 1])
        if smoothed_loss > hi or smoothed_loss < lo:
            return (
                f"ladder_band: smoothed loss {smoothed_loss:.4f} outside the predicted [{lo:.4f}, {hi:.4f}]"
            )
        return None

    def at(self, step: int) -> list[float]:
        return [round(float(self.lower[step - 1]), 4), round(float(self.upper[step - 1]), 4)]
