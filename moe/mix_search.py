"""Mixture search: small proxy runs on mixes drawn around the declared weights choose the target's mix.

RegMix's recipe at this project's scale. Proxy 0 trains on the declared weights, the others on Dirichlet draws
(alpha_d = `concentration` * w_d, seeded by the run's seed) over the domains the declared mix uses; every proxy is
the target's recipe at `width` x `layers`, its LM head over `output_classes` token classes (each next token's id
modulo their number) and then, with `factored_head`, over the class's members in place of the vocabulary (a proxy's
loss is then each token's own cross-entropy, as the target's is), on its own mix of the whole curriculum (each
phase's weights tilted by the draw: `MixConfig.tilted`; at one seed every mix draws the same text first,
`tokenize/mix.py`), and all of them together cost at most `budget_fraction` of the target's training FLOPs, none
training longer than the target. Each proxy's held-out loss per domain (on proxy 0's held-out rows, the same for
all) is what the regression fits, per domain: loss_d ~ c_d + sum_j b_dj * log(w_j), a domain's diminishing return on
its own share (b_dd) and what the other domains teach it (b_dj, transfer), by least squares with a ridge penalty on
the transfer coefficients; the penalty (none to infinite, the latter a law of the domain's own weight alone) is the
one of `RIDGES` whose fit predicts the proxies it leaves out best. The predicted objective reduces the predicted
losses as `objective` says. Its out-of-sample quality is the Spearman rank correlation of leave-one-out predictions
with the proxies' domain losses, averaged over domains (the objective's own is recorded beside it: the objective
moves least of all, as its domains pull against each other). The chosen mix is the draw (among `CANDIDATES` from the
same Dirichlet inside the proxies' range of each weight, plus the proxies' own) with the lowest predicted objective
whose domains the target can train within `mix.max_epochs`: the search stays where its proxies looked. The record
also holds the declared mix's predicted objective, the gain the fit expects of the move, and the fit's leave-one-out
RMS error on the objective. The proxies do not support moving the mix, and the declared one is kept (the record says
which), when the leave-one-out rank correlation is under `min_rank_correlation` or the gain is under
`min_gain_to_error` times that error: a gain the proxies cannot tell from their own noise. `search.json`
pre-registers it, with its time, before the target's mix is built.
"""

from __future__ import annotations

import json
import math
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from scipy.stats import spearmanr

from moeflow.configs import ConfigError, EvalConfig, RunConfig
from moeflow.configs.data import MixSearchConfig, tilt
from moeflow.moe import evaluate, ladder
from moeflow.tokenize import tokenizer

CANDIDATES = 4096  # Dirichlet draws the chosen mix is picked from
FLOOR = 1e-4  # weights are clipped here before the log
# ridge penalties the fit chooses among by leave-one-out error (inf: no transfer between domains)
RIDGES = (0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, math.inf)


def draws(weights: dict[str, float], concentration: float, n: int, seed: int) -> list[dict[str, float]]:
    """`n` mixes from the Dirichlet around `weights` (domains of weight 0 stay at 0)."""
    used = [d for d, w in weights.items() if w > 0]
    total = sum(weights[d] for d in used)
    alpha = np.array([concentration * weights[d] / total for d in used])
    x = np.random.default_rng(seed).dirichlet(alpha, n)
    return [{d: (float(row[used.index(d)]) if d in used else 0.0) for d in weights} for row in x]


def plan(cfg: RunConfig, vocab: int) -> list[dict]:
    """The proxies: each one's config (model, train and tilted mix), weights and FLOPs; proxy 0 is declared."""
    s = cfg.mix.search
    declared = {d: w / sum(cfg.mix.weights.values()) for d, w in cfg.mix.weights.items()}
    mixes = [declared] + draws(declared, s.concentration, s.proxies - 1, cfg.seed)
    target, _ = ladder.flops(cfg.model, cfg.train, vocab, [(p.steps, p.seq_len) for p in cfg.phases()])
    model = ladder._model(cfg.model, s.width, s.layers)
    if s.output_classes and s.output_classes < vocab:
        model = model.model_copy(update={"output_classes": s.output_classes, "tie_embeddings": False,
                                         "factored_head": s.factored_head})
    full, _ = ladder.flops(model, cfg.train, vocab, [(p.steps, p.seq_len) for p in cfg.phases()])
    affordable = int(s.budget_fraction * target / s.proxies / (full / cfg.train.steps))  # within the budget
    steps = max(s.min_steps, min(cfg.train.steps, affordable))  # never past the target's own length
    train = cfg.train.model_copy(update={
        "steps": steps, "warmup_steps": round(cfg.train.warmup_steps * steps / cfg.train.steps),
        "checkpoint_every": steps})
    out = []
    for w in mixes:
        pcfg = cfg.model_copy(update={"model": model, "train": train, "mix": cfg.mix.tilted(w)})
        f, _ = ladder.flops(model, train, vocab, [(p.steps, p.seq_len) for p in pcfg.phases()])
        out.append({"cfg": pcfg, "weights": w, "flops": f})
    share = sum(p["flops"] for p in out) / target
    if share > s.budget_fraction * 1.05:  # min_steps beat the budget
        raise ConfigError(
            f"mix.search: {s.proxies} proxies of at least {s.min_steps} steps at width {s.width} cost {share:.0%} of "
            f"the target's training FLOPs, over mix.search.budget_fraction = {s.budget_fraction:g}; lower "
            "proxies, width or min_steps")
    return out


def _design(mixes: list[dict[str, float]], domains: list[str]) -> np.ndarray:
    return np.c_[np.ones(len(mixes)), np.log([[max(m[d], FLOOR) for d in domains] for m in mixes])]


def fit(mixes: list[dict[str, float]], losses: list[dict[str, float]], domains: list[str],
        ridge: float = math.inf) -> dict[str, list[float]]:
    """Per domain d, its held-out loss ~ c_d + sum_j b_dj * log(w_j) over the domains j: [c_d, b_d1, ...], by
    least squares over the proxies, the other domains' coefficients (transfer) shrunk by a ridge penalty
    `ridge` (inf: none, a domain's loss depends on its own weight alone)."""
    X, n = _design(mixes, domains), len(domains)
    law = {}
    for k, d in enumerate(domains):
        y = np.array([loss[d] for loss in losses])
        if math.isinf(ridge):
            (c, b), *_ = np.linalg.lstsq(X[:, [0, k + 1]], y, rcond=None)
            law[d] = [float(c)] + [float(b) if j == k else 0.0 for j in range(n)]
            continue
        penalty = np.sqrt(ridge) * np.diag([0.0] + [0.0 if j == k else 1.0 for j in range(n)])
        coef, *_ = np.linalg.lstsq(np.r_[X, penalty], np.r_[y, np.zeros(n + 1)], rcond=None)
        law[d] = [float(v) for v in coef]
    return law


def predict(law: dict[str, list[float]], mixes: list[dict[str, float]]) -> list[dict[str, float]]:
    X = _design(mixes, list(law))
    return [{d: float(row @ np.array(coef)) for d, coef in law.items()} for row in X]


def loo(mixes: list[dict[str, float]], losses: list[dict[str, float]], domains: list[str],
        ridge: float = math.inf) -> list[dict]:
    """Each proxy's domain losses as predicted by a fit on the other proxies."""
    out = []
    for k in range(len(mixes)):
        rest = [i for i in range(len(mixes)) if i != k]
        out += predict(fit([mixes[i] for i in rest], [losses[i] for i in rest], domains, ridge), [mixes[k]])
    return out


def select_ridge(mixes: list[dict[str, float]], losses: list[dict[str, float]], domains: list[str]) -> float:
    """The ridge of `RIDGES` whose fit predicts the proxies it leaves out best (squared error, summed over
    domains); on a tie the larger, the simpler law."""
    def error(r: float) -> float:
        return sum((p[d] - y[d]) ** 2 for p, y in zip(loo(mixes, losses, domains, r), losses) for d in domains)
    return min(reversed(RIDGES), key=error)


def _rho(a: list[float], b: list[float]) -> float:
    return float(spearmanr(a, b).statistic) if len(set(a)) > 1 and len(set(b)) > 1 else float("nan")


def epochs(w: dict[str, float], s: dict, domain_tokens: dict[str, int]) -> dict[str, float]:
    """Each domain's expected repetitions over the target run on weights `w` (its training tokens estimated as
    the store's less the held-out fraction)."""
    need: dict[str, float] = {}
    for p in s["phases"]:
        for d, x in tilt(p.weights, s["weights"], w).items():
            need[d] = need.get(d, 0.0) + p.steps * s["batch_size"] * p.seq_len * x
    return {d: n / max(1.0, domain_tokens.get(d, 0) * (1 - s["heldout_fraction"])) for d, n in need.items()}


def choose(s: dict, mixes: list[dict], losses: list[dict[str, float]], domain_tokens: dict[str, int]) -> dict:
    """The fit (its ridge chosen by leave-one-out error), its leave-one-out rank correlations, and the feasible
    candidate it predicts best."""
    search = s["search"]
    domains = [d for d, w in s["weights"].items() if w > 0]
    ridge = select_ridge(mixes, losses, domains)
    law, held = fit(mixes, losses, domains, ridge), loo(mixes, losses, domains, ridge)
    per_domain = {d: _rho([p[d] for p in held], [loss[d] for loss in losses]) for d in domains}
    rho = float(np.mean(list(per_domain.values())))
    seen = [{d: loss[d] for d in domains} for loss in losses]
    objective_rho = _rho([search.reduce(p) for p in held], [search.reduce(x) for x in seen])
    pool = mixes + [m for m in draws(s["weights"], search.concentration, CANDIDATES, s["seed"] + 1)
                    if inside(m, mixes, domains)]
    pred = np.array([search.reduce(p) for p in predict(law, pool)])
    feasible = [i for i in np.argsort(pred) if max(epochs(pool[i], s, domain_tokens).values()) <= s["max_epochs"]]
    if not feasible:
        raise ConfigError("mix.search: no candidate mix fits mix.max_epochs; raise it or add data")
    declared = search.reduce(predict(law, [s["weights"]])[0])
    loo_error = [search.reduce(p) - search.reduce(x) for p, x in zip(held, seen)]
    rmse = float(np.sqrt(np.mean(np.square(loo_error))))
    top = int(feasible[0])
    gain = declared - float(pred[top])
    best, why = _gate(top, rho, gain, rmse, search)
    return {"law": {d: {"c": c[0], "b": dict(zip(domains, c[1:]))} for d, c in law.items()},
            "ridge": None if math.isinf(ridge) else ridge, "loo_rank_correlation": rho,
            "loo_rank_correlation_per_domain": per_domain, "loo_objective_rank_correlation": objective_rho,
            "loo_predicted": [search.reduce(p) for p in held], "chosen_as": why,
            "weights": {d: round(v, 6) for d, v in pool[best].items()}, "predicted_objective": float(pred[best]),
            # what the fit expects the move to gain, beside how far it misses the objective of a proxy it left out
            "predicted_declared": declared, "predicted_gain": declared - float(pred[best]),
            "loo_objective_rmse": rmse,
            # the fit's lowest feasible candidate and its gain, moved to or not
            "candidate": {d: round(v, 6) for d, v in pool[top].items()}, "candidate_gain": gain,
            "epochs": epochs(pool[best], s, domain_tokens)}


def _gate(best: int, rho: float, gain: float, rmse: float, search: MixSearchConfig) -> tuple[int, str]:
    """The candidate `best`, or 0 (the declared mix) where the proxies do not support moving: their leave-one-out
    rank correlation `rho` is under `min_rank_correlation`, or the `gain` the fit expects is under
    `min_gain_to_error` times its leave-one-out RMS error on the objective. With the reason."""
    if not rho >= search.min_rank_correlation:  # (nan too)
        return 0, f"declared: the leave-one-out rank correlation {rho:.3f} < {search.min_rank_correlation:g}"
    if gain < search.min_gain_to_error * rmse:
        return 0, (f"declared: the gain the fit expects, {gain:.4f}, is under {search.min_gain_to_error:g} x its "
                   f"leave-one-out error on the objective, {rmse:.4f}")
    return best, "the fit's lowest predicted objective"


def inside(m: dict[str, float], mixes: list[dict[str, float]], domains: list[str]) -> bool:
    """Whether every weight of `m` lies within the proxies' range for its domain (the fit's trust region)."""
    return all(min(x[d] for x in mixes) - 1e-6 <= m[d] <= max(x[d] for x in mixes) + 1e-6 for d in domains)


def _domain_tokens(shards: Path) -> dict[str, int]:
    t = pq.read_table(Path(shards) / "index.parquet", columns=["domain", "tokens"]).group_by("domain")
    agg = t.aggregate([("tokens", "sum")]).to_pylist()
    return {r["domain"]: int(r["tokens_sum"]) for r in agg}


def stage(s: dict, inputs: dict, out: Path) -> dict:
    """The `mix_search` stage's body: the proxies' objectives, the fit, the chosen mix, `search.json`."""
    search = s["search"]
    mixes = [s["weights"]] + draws(s["weights"], search.concentration, search.proxies - 1, s["seed"])
    names = sorted((k for k in inputs if k.startswith("proxy") and not k.startswith("proxy_mix")),
                   key=lambda k: int(k[5:]))
    if len(names) != len(mixes):
        raise ValueError(f"mix_search: {len(names)} proxies given, the search declares {len(mixes)}")
    ev = EvalConfig(max_sequences_per_domain=s["eval_sequences"], device=s["device"])
    rows = []
    for name, w in zip(names, mixes):
        with tempfile.TemporaryDirectory() as tmp:
            held = evaluate.run(ev, train_dir=inputs[name].dir, mix_dir=inputs["proxy_mix0"].dir, out=Path(tmp))
        stats = json.loads((inputs[name].dir / "lineage.json").read_text())["stats"]
        rows.append({"proxy": name, "weights": w, "flops": stats["flops"], "steps": stats["steps"],
                     "tokens": stats["tokens"], "heldout": {d: v["loss"] for d, v in held["heldout"].items()}})
        rows[-1]["objective"] = search.reduce(rows[-1]["heldout"])
    chosen = choose(s, mixes, [r["heldout"] for r in rows], _domain_tokens(inputs["shards"].dir))
    vocab = tokenizer.load(inputs["tokenizer"].dir).get_vocab_size()
    target, _ = ladder.flops(s["model"], s["train"], vocab, [(p.steps, p.seq_len) for p in s["phases"]])
    tokens = sum(p.steps * p.seq_len for p in s["phases"]) * s["train"].batch_size
    result = {"registered_at": datetime.now(UTC).isoformat(timespec="seconds"),
              "objective": search.objective, "declared": s["weights"], **chosen, "proxies": rows,
              "proxy_flops": sum(r["flops"] for r in rows), "target_flops": target,
              "proxy_fraction": sum(r["flops"] for r in rows) / target,
              # how far into the target's training the proxies got (benchmarks/README.md, mix_search.py)
              "proxy_token_fraction": max(r["tokens"] for r in rows) / tokens}
    (out / "search.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    return result  # in lineage too: the card's section reads it there
