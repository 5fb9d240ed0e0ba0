"""The optimizer and its learning rate at each step: AdamW, linear warmup, then cosine decay or
warmup-stable-decay."""

from __future__ import annotations

import math

import torch

from moeflow.configs import TrainConfig


def decays(name: str, p: torch.nn.Parameter, cfg: TrainConfig) -> bool:
    """Weight decay on matrices only: decaying norm gains would pull them towards zero, not towards 1. The
    tied embedding / LM head is left out too unless `train.embedding_weight_decay` (OLMo-core's default):
    decay shrinks the rows of rare tokens, whose gradients seldom push back."""
    return p.dim() >= 2 and (cfg.embedding_weight_decay or not name.startswith("embed."))


def adamw(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if decays(n, p, cfg)]
    no_decay = [p for n, p in model.named_parameters() if not decays(n, p, cfg)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "wsd":
        decay_start = cfg.steps - max(1, round(cfg.decay_fraction * cfg.steps))
        if step < decay_start:
            return cfg.lr
        return cfg.lr - (cfg.lr - floor) * (step - decay_start + 1) / (cfg.steps - decay_start)
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
