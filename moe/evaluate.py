"""Evaluation: held-out cross-entropy per domain on the mix's held-out sequences."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from moeflow.configs import EvalConfig, ModelConfig
from moeflow.moe import device
from moeflow.moe.model import Transformer
from moeflow.moe.train import lm_loss, sequences
from moeflow.tokenize import mix


def stage(cfg: EvalConfig, inputs: dict, out: Path) -> dict:
    """The `evaluate` stage's body: the `model` input's final weights on the `mix` input's held-out set."""
    return run(cfg, train_dir=inputs["model"].dir, mix_dir=inputs["mix"].dir, out=out)


def load_model(train_dir: Path) -> Transformer:
    meta = json.loads((Path(train_dir) / "model_config.json").read_text())
    vocab, seq_len = meta.pop("vocab_size"), meta.pop("max_seq_len")
    model = Transformer(ModelConfig(**meta), vocab, seq_len)
    model.load_state_dict(load_file(str(Path(train_dir) / "model.safetensors")), strict=True)
    return model.eval()


@torch.no_grad()
def run(cfg: EvalConfig, *, train_dir: Path, mix_dir: Path, out: Path) -> dict:
    dev = device.resolve("auto")
    model = load_model(train_dir).to(dev)
    path = Path(mix_dir) / "heldout.arrow"
    data = sequences(path)
    domains = np.asarray(mix.read(path).column("domain").to_pylist())
    results = {}
    for domain in sorted(set(domains.tolist())):
        rows = data[domains == domain][: cfg.max_sequences_per_domain]
        losses = [lm_loss(model, device.batch(rows[i : i + 8], dev))[0].item() * len(rows[i : i + 8])
                  for i in range(0, len(rows), 8)]
        loss = sum(losses) / len(rows)
        results[domain] = {
            "loss": round(loss, 4),
            "perplexity": round(math.exp(loss), 2),
            "sequences": int(len(rows)),
            "tokens": int(len(rows) * (rows.shape[1] - 1)),
        }
    (out / "eval.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    return {"heldout": results}
