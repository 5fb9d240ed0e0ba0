"""The optimizer's learning rate at each step: linear warmup, then cosine decay or warmup-stable-decay."""

from __future__ import annotations

import math

from moeflow.configs import TrainConfig


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
