"""Mixture search: small proxy runs on mixes drawn around the declared weights choose the target's mix.

RegMix's recipe at this project's scale. Proxy 0 trains on the declared weights, the others on Dirichlet draws
(alpha_d = `concentration` * w_d, seeded by the run's seed) over the domains the declared mix uses; every
proxy is the target's recipe at `width` x `layers`, on its own mix of the whole curriculum (each phase's
weights tilted by the draw: `MixConfig.tilted`), and all of them together cost `budget_fraction` of the
target's training FLOPs. Each proxy's held-out loss per domain (on proxy 0's held-out rows, the same for all)
gives its objective. The regression is objective ~ c + sum_d b_d * log(w_d): a per-domain diminishing return,
D + 1 coefficients from K proxies, least squares. Its out-of-sample quality is the Spearman rank correlation of
leave-one-out predictions with the proxies' objectives. The chosen mix is the draw (among `CANDIDATES` from the
same Dirichlet inside the proxies' range of each weight, plus the proxies' own) with the lowest predicted
objective whose domains the target can train within `mix.max_epochs`: the search stays where its proxies
looked. When the leave-one-out rank correlation is under `min_rank_correlation`, the proxies do not support
moving the mix and the declared one is kept (the record says which). `search.json` pre-registers it, with its
time, before the target's mix is built.
"""

from __future__ import annotations

import json
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from scipy.stats import spearmanr

from moeflow.configs import ConfigError, EvalConfig, RunConfig
from moeflow.configs.data import tilt
from moeflow.moe import evaluate, ladder
from moeflow.tokenize import tokenizer

CANDIDATES = 4096  # Dirichlet draws the chosen mix is picked from
FLOOR = 1e-4  # weights are clipped here before the log


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
    full, _ = ladder.flops(model, cfg.train, vocab, [(p.steps, p.seq_len) for p in cfg.phases()])
    steps = max(s.min_steps, round(s.budget_fraction * target / s.proxies / (full / cfg.train.steps)))
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


def features(mixes: list[dict[str, float]], domains: list[str]) -> np.ndarray:
    return np.array([[1.0] + [np.log(max(m[d], FLOOR)) for d in domains] for m in mixes])


def fit(mixes: list[dict[str, float]], y: list[float], domains: list[str]) -> np.ndarray:
    coef, *_ = np.linalg.lstsq(features(mixes, domains), np.asarray(y), rcond=None)
    return coef


def loo_rank_correlation(mixes: list[dict[str, float]], y: list[float], domains: list[str]) -> tuple[float, list]:
    """Spearman's rho of each proxy's objective predicted by a fit on the others, and those predictions."""
    pred = []
    for k in range(len(mixes)):
        rest = [i for i in range(len(mixes)) if i != k]
        coef = fit([mixes[i] for i in rest], [y[i] for i in rest], domains)
        pred.append(float(features([mixes[k]], domains)[0] @ coef))
    rho = spearmanr(pred, y).statistic if len(set(y)) > 1 else float("nan")
    return float(rho), pred


def epochs(w: dict[str, float], s: dict, domain_tokens: dict[str, int]) -> dict[str, float]:
    """Each domain's expected repetitions over the target run on weights `w` (its training tokens estimated as
    the store's less the held-out fraction)."""
    need: dict[str, float] = {}
    for p in s["phases"]:
        for d, x in tilt(p.weights, s["weights"], w).items():
            need[d] = need.get(d, 0.0) + p.steps * s["batch_size"] * p.seq_len * x
    return {d: n / max(1.0, domain_tokens.get(d, 0) * (1 - s["heldout_fraction"])) for d, n in need.items()}


def choose(s: dict, mixes: list[dict], y: list[float], domain_tokens: dict[str, int]) -> dict:
    """The fit, its leave-one-out rank correlation, and the feasible candidate it predicts best."""
    search = s["search"]
    domains = [d for d, w in s["weights"].items() if w > 0]
    coef = fit(mixes, y, domains)
    rho, loo = loo_rank_correlation(mixes, y, domains)
    pool = mixes + [m for m in draws(s["weights"], search.concentration, CANDIDATES, s["seed"] + 1)
                    if inside(m, mixes, domains)]
    pred = features(pool, domains) @ coef
    feasible = [i for i in np.argsort(pred) if max(epochs(pool[i], s, domain_tokens).values()) <= s["max_epochs"]]
    if not feasible:
        raise ConfigError("mix.search: no candidate mix fits mix.max_epochs; raise it or add data")
    best = int(feasible[0])
    why = "the fit's lowest predicted objective"
    if not rho >= search.min_rank_correlation:  # (nan too) the proxies do not support moving the mix
        best, why = 0, f"declared: the leave-one-out rank correlation {rho:.3f} < {search.min_rank_correlation:g}"
    return {"coef": dict(zip(["intercept", *domains], map(float, coef))), "loo_rank_correlation": rho,
            "loo_predicted": loo, "weights": {d: round(v, 6) for d, v in pool[best].items()}, "chosen_as": why,
            "predicted_objective": float(pred[best]), "epochs": epochs(pool[best], s, domain_tokens)}


def inside(m: dict[str, float], mixes: list[dict[str, float]], domains: list[str]) -> bool:
    """Whether every weight of `m` lies within the proxies' range for its domain (the fit's trust region)."""
    return all(min(x[d] for x in mixes) <= m[d] <= max(x[d] for x in mixes) for d in domains)


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
                     "heldout": {d: v["loss"] for d, v in held["heldout"].items()}})
        rows[-1]["objective"] = search.reduce(rows[-1]["heldout"])
    chosen = choose(s, mixes, [r["objective"] for r in rows], _domain_tokens(inputs["shards"].dir))
    vocab = tokenizer.load(inputs["tokenizer"].dir).get_vocab_size()
    target, _ = ladder.flops(s["model"], s["train"], vocab, [(p.steps, p.seq_len) for p in s["phases"]])
    result = {"registered_at": datetime.now(UTC).isoformat(timespec="seconds"),
              "objective": search.objective, "declared": s["weights"], **chosen, "proxies": rows,
              "proxy_flops": sum(r["flops"] for r in rows), "target_flops": target,
              "proxy_fraction": sum(r["flops"] for r in rows) / target}
    (out / "search.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    return result  # in lineage too: the card's section reads it there
