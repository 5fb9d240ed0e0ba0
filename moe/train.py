"""The training loop: AdamW, warmup + cosine, gradient clipping, fixed seeds, per-step health metrics.

Reads packed sequences from a mix artifact in order (step i takes rows [i*B, (i+1)*B)) and writes
`model.safetensors`, `model_config.json` and `metrics.jsonl` (one line per step: loss, cross-entropy,
load-balancing and z-losses, grad norm, learning rate, tokens/s, tokens per expert per layer,
load imbalance max/mean, token drop rate: 0, since the layer is dropless).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from moeflow.configs import ModelConfig, TrainConfig
from moeflow.moe.model import Transformer
from moeflow.tokenize import mix
from moeflow.tokenize.tokenizer import load as load_tokenizer

VERSION = 1


def sequences(path: Path) -> np.ndarray:
    """A mix output file as an int64 array [rows, seq_len + 1]."""
    col = mix.read(path).column("tokens").combine_chunks()
    return col.flatten().to_numpy().astype(np.int64).reshape(len(col), col.type.list_size)


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def lm_loss(model: Transformer, batch_BS: torch.Tensor) -> tuple[torch.Tensor, list[dict]]:
    logits_BSV, auxes = model(batch_BS[:, :-1])
    ce = F.cross_entropy(logits_BSV.reshape(-1, logits_BSV.shape[-1]).float(), batch_BS[:, 1:].reshape(-1))
    return ce, auxes


def build_model(model_cfg: ModelConfig, vocab_size: int, seq_len: int, seed: int) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(model_cfg, vocab_size, seq_len)


def run(model_cfg: ModelConfig, cfg: TrainConfig, *, seed: int, mix_dir: Path, tokenizer_dir: Path, out: Path) -> dict:
    torch.set_num_threads(os.cpu_count() or 1)
    data = sequences(Path(mix_dir) / "train.arrow")
    needed = cfg.steps * cfg.batch_size
    if len(data) < needed:
        raise ValueError(f"train: the mix holds {len(data)} sequences, {needed} are needed (steps x batch_size)")
    vocab = load_tokenizer(tokenizer_dir).get_vocab_size()
    model = build_model(model_cfg, vocab, cfg.seq_len, seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    params = model.num_params()
    tokens_per_step = cfg.batch_size * cfg.seq_len
    log_path = out / "metrics.jsonl"
    losses: list[float] = []
    start = time.perf_counter()
    with open(log_path, "w") as log, tqdm(total=cfg.steps, desc="train", unit="step", mininterval=5) as bar:
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            lr = lr_at(step, cfg)
            for group in opt.param_groups:
                group["lr"] = lr
            batch = torch.from_numpy(data[step * cfg.batch_size : (step + 1) * cfg.batch_size])
            ce, auxes = lm_loss(model, batch)
            lb = torch.stack([a["load_balancing_loss"] for a in auxes]).mean()
            z = torch.stack([a["router_z_loss"] for a in auxes]).mean()
            loss = ce + cfg.load_balance_coef * lb + cfg.router_z_coef * z
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            dt = time.perf_counter() - t0
            per_expert = [a["tokens_per_expert"].tolist() for a in auxes]
            imbalance = [max(c) / (sum(c) / len(c)) for c in per_expert]
            losses.append(ce.item())
            record = {"step": step + 1, "loss": round(loss.item(), 5), "ce": round(ce.item(), 5),
                      "load_balancing_loss": round(lb.item(), 5), "router_z_loss": round(z.item(), 5),
                      "grad_norm": round(grad_norm.item(), 5), "lr": lr, "tokens_per_s": round(tokens_per_step / dt, 1),
                      "tokens_per_expert": per_expert, "load_imbalance": [round(x, 4) for x in imbalance],
                      "token_drop_rate": 0.0}
            log.write(json.dumps(record) + "\n")
            bar.update(1)
            if (step + 1) % cfg.log_every == 0:
                bar.set_postfix(loss=f"{ce.item():.3f}", gnorm=f"{grad_norm.item():.2f}")
    elapsed = time.perf_counter() - start
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    (out / "model_config.json").write_text(json.dumps({**model_cfg.model_dump(mode="json"), "vocab_size": vocab,
                                                       "max_seq_len": cfg.seq_len}, indent=2, sort_keys=True))
    head = float(np.mean(losses[: min(10, len(losses))]))
    tail = float(np.mean(losses[-min(10, len(losses)) :]))
    return {"steps": cfg.steps, "tokens": cfg.steps * tokens_per_step, "batch_size": cfg.batch_size,
            "seq_len": cfg.seq_len, "params_total": params["total"], "params_active": params["active"],
            "initial_loss": round(head, 4), "final_loss": round(tail, 4), "loss_fell": tail < head,
            "tokens_per_s": round(cfg.steps * tokens_per_step / elapsed, 1), "train_seconds": round(elapsed, 1),
            "vocab_size": vocab, "token_drop_rate": 0.0}
