"""Expert balance and held-out loss of tiny's model under each balancer: none, the Switch loss, DeepSeek-V3's
auxiliary-loss-free expert bias, its sequence-wise loss.

Run: `python benchmarks/balance.py [--steps N] [--seed 1234] [--store DIR]`.

One `moeflow run tiny --until mix` gives the tokenizer and the mix (reused from the store when it holds them);
then tiny's model and training config (with `--steps`, a run of that many steps on the mix's first rows) train
once per balancer through `moe.train.run`, each from the same seed
on the same rows, and `moe.evaluate.run` scores the held-out rows as the evaluate stage does. The balancers:
`none` (load_balance_coef 0), `switch` (tiny's own, load_balance_coef 0.01), `aux_loss_free` (no loss,
model.router_bias_rate 1e-3, DeepSeek-V3's rate) and `sequence` (no batch loss, sequence_balance_coef 0.01). Per
balancer: the held-out loss averaged over domains, the load imbalance (max / mean tokens per expert) of each MoE
layer at the last step and averaged over the last fifth of the steps, the mean sequence-wise balance loss over them
(1 is even routing within every sequence), and the training seconds. The last line is one JSON object of them.
What it does not show: more than one seed, longer runs, or any model but tiny's shape.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import yaml
from _runs import run_until  # benchmarks/_runs.py: not a benchmark (scripts run from benchmarks/)

from moeflow import configs
from moeflow.configs import EvalConfig
from moeflow.moe import evaluate, train

BALANCERS = {
    "none": ({}, {"load_balance_coef": 0.0}),
    "switch": ({}, {}),
    "aux_loss_free": ({"router_bias_rate": 1e-3}, {"load_balance_coef": 0.0}),
    "sequence": ({}, {"load_balance_coef": 0.0, "sequence_balance_coef": 0.01}),
}


def run_one(cfg: configs.RunConfig, model: dict, trainer: dict, mix_dir: Path, tokenizer_dir: Path,
            out: Path) -> dict:
    out.mkdir()
    summary = train.run(cfg.model.model_copy(update=model), cfg.train.model_copy(update=trainer), seed=cfg.seed,
                        mix_dir=mix_dir, tokenizer_dir=tokenizer_dir, out=out)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = records[-len(records) // 5:]  # the last fifth of the steps
    held = evaluate.run(EvalConfig(max_sequences_per_domain=cfg.evaluate.max_sequences_per_domain),
                        train_dir=out, mix_dir=mix_dir, out=out)["heldout"]
    return {
        "heldout_loss": round(float(np.mean([d["loss"] for d in held.values()])), 4),
        "final_load_imbalance": summary["final_load_imbalance"],
        "tail_load_imbalance": np.mean([r["load_imbalance"] for r in records], axis=0).round(4).tolist(),
        "tail_sequence_balancing_loss": round(float(np.mean([r["sequence_balancing_loss"] for r in records])), 4),
        "train_seconds": summary["train_seconds"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="the first this many of tiny's steps (default: all)")
    p.add_argument("--seed", type=int, default=None, help="default: tiny's")
    p.add_argument("--store", default=None, help="artifact store (default: the config's own)")
    args = p.parse_args()
    data = yaml.safe_load(configs.resolve("tiny").read_text())
    data["seed"] = args.seed if args.seed is not None else data["seed"]
    if args.store:
        data["store"] = args.store
    results = {}
    with tempfile.TemporaryDirectory() as work:
        root, stages = run_until(data, "tiny-balance", "mix", Path(work))
        cfg = configs.load(Path(work) / "tiny-balance.yaml")
        mix_dir, tokenizer_dir = (root / s / f"{s}-{stages[s]['hash']}" for s in ("mix", "tokenizer"))
        for name, (model, trainer) in BALANCERS.items():
            steps = {"steps": args.steps} if args.steps else {}
            r = results[name] = run_one(cfg, model, trainer | steps, mix_dir, tokenizer_dir, Path(work) / name)
            print(f"{name}: held-out loss {r['heldout_loss']}, load imbalance at the end {r['final_load_imbalance']}, "
                  f"over the last fifth {r['tail_load_imbalance']}, sequence balance loss "
                  f"{r['tail_sequence_balancing_loss']}, {r['train_seconds']} s", flush=True)
    print(json.dumps({"steps": args.steps or cfg.train.steps, "seed": cfg.seed, "balancers": results}))


if __name__ == "__main__":
    main()
