"""What a training step measures beyond its losses: gradient norms per parameter group, alarms on loss
spikes and grad-norm jumps, and under torchrun each rank's timings and expert load.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import torch

from moeflow.configs import AlarmConfig, TrainConfig
from moeflow.moe import parallel

PARAM_GROUPS = (
    ("router", ".router."),
    ("experts", ".experts."),
    ("shared_expert", ".shared_expert."),
    ("dense_mlp", ".mlp."),
    ("attention", ".attn."),
    ("embedding", "embed."),
    ("norms", "norm"),
)


def group_of(name: str) -> str:
    return next((g for g, key in PARAM_GROUPS if key in f".{name}"), "other")


def group_grad_norms(model: torch.nn.Module) -> dict[str, float]:
    sums: dict[str, float] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        group = group_of(name)
        sums[group] = sums.get(group, 0.0) + float(p.grad.detach().float().square().sum())
    return {g: round(math.sqrt(v), 5) for g, v in sorted(sums.items())}


class Monitor:
    """Alarms for loss spikes and grad-norm jumps against the band of the last `window` steps."""

    def __init__(self, cfg: AlarmConfig):
        self.cfg = cfg
        self.losses: deque[float] = deque(maxlen=cfg.window)
        self.norms: deque[float] = deque(maxlen=cfg.window)

    def check(self, loss: float, grad_norm: float) -> list[str]:
        alarms = []
        if len(self.losses) == self.cfg.window:
            median = statistics.median(self.losses)
            if loss > (1 + self.cfg.loss_spike) * median:
                alarms.append(
                    f"loss_spike: {loss:.4f} > {(1 + self.cfg.loss_spike):.2f} x median {median:.4f}"
                )
            mean, std = statistics.fmean(self.norms), statistics.pstdev(self.norms)
            if grad_norm > max(mean + self.cfg.grad_norm_sigma * std, self.cfg.grad_norm_ratio * mean):
                alarms.append(
                    f"grad_norm: {grad_norm:.4f} > mean {mean:.4f} + "
                    f"{self.cfg.grad_norm_sigma} x std {std:.4f}"
                )
        self.losses.append(loss)
        self.norms.append(grad_norm)
        return alarms


def rank_metrics(world: parallel.World, step_s: float, moe_layers: int) -> list[dict]:
    """Every rank's step time, all-to-all time and tokens its experts processed per MoE layer.

    Gathered on all ranks.
    """
    all_to_all_s, received = world.take_timer()
    per_layer = (
        [torch.stack(received[i::moe_layers]).sum(0).tolist() for i in range(moe_layers)] if received else []
    )
    return world.gather_object(
        {
            "rank": world.rank,
            "step_s": round(step_s, 5),
            "all_to_all_s": round(all_to_all_s, 5),
            "expert_tokens": per_layer,
        }
    )


def distributed_summary(cfg: TrainConfig, records: list[dict]) -> dict | None:
    """Per rank over the run: share of step time in the token all-to-all, tokens its experts processed."""
    steps = [r["ranks"] for r in records if "ranks" in r]
    if not steps:
        return None
    ranks = []
    for i in range(len(steps[0])):
        step_s = sum(s[i]["step_s"] for s in steps)
        ranks.append(
            {
                "rank": i,
                "all_to_all_share": round(sum(s[i]["all_to_all_s"] for s in steps) / step_s, 4),
                "expert_tokens": [
                    [sum(col) for col in zip(*(s[i]["expert_tokens"][layer] for s in steps))]
                    for layer in range(len(steps[0][i]["expert_tokens"]))
                ],
                "step_s": round(step_s, 2),
            }
        )
    return {
        "world_size": len(ranks),
        "nnodes": cfg.distributed.nnodes,
        "expert_parallel": cfg.distributed.expert_parallel,
        "ranks": ranks,
    }
