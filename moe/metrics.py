"""What training measures: each step's line of `metrics.jsonl`, gradient norms per parameter group, under
torchrun each rank's timings and expert load, and the summary of a whole run.

A step's record holds: loss, cross-entropy, load-balancing (over the batch and per sequence), router z and logit
z losses, grad norm (total and per parameter group), learning rate, tokens/s (the whole batch's, over every
rank), achieved TFLOP/s per device and MFU (when the device's peak is configured or known), tokens per expert
per MoE layer, load imbalance (max/mean) and token drop rate. MFU is per device: the step's model FLOPs (6 x
active parameters + attention, per token, times the batch's tokens) over its time on rank 0, divided by the
number of devices that shared them and by one device's peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from moeflow.configs import ModelConfig, TrainConfig
from moeflow.moe import ladder, parallel
from moeflow.moe.model import Transformer

PARAM_GROUPS = (
    ("router", ".router."),
    ("experts", ".experts."),
    ("shared_expert", ".shared_expert."),
    ("dense_mlp", ".mlp."),
    ("attention", ".attn."),
    ("embedding", "embed."),
    ("lm_head", "head."),
    ("lm_head", ".within"),  # a factored head's per-token vectors (model.factored_head)
    ("lm_head", ".head_bias"),  # the head's unigram bias (model.unigram_head_bias)
    ("norms", "norm"),
)



@dataclass
class Step:
    """One optimizer step's measurements before rounding (the alarms, TensorBoard and the progress bar see
    these); `record` is its line of metrics.jsonl."""

    number: int  # counted from 1, as metrics.jsonl and the checkpoints count
    phase: int
    seq_len: int
    lr: float
    micro_batches: int
    # each loss term summed over the micro-batches (under torchrun: its mean over ranks)
    ce_sum: float
    load_balancing_sum: float
    sequence_balancing_sum: float
    router_z_sum: float
    logit_z_sum: float
    grad_norm: float
    grad_norm_groups: dict[str, float]
    tokens_per_expert: list[list[int]]  # per MoE layer, over every rank
    dropped: int
    seconds: float
    tokens: int  # the whole batch's, over every rank
    flops_per_token: int
    devices: int = 1  # ranks that computed the batch together

    @property
    def ce(self) -> float:
        return self.ce_sum / self.micro_batches

    @property
    def imbalance(self) -> list[float]:
        return [max(c) / (sum(c) / len(c)) for c in self.tokens_per_expert]

    def record(self, cfg: TrainConfig, peak: float | None) -> dict:
        n = self.micro_batches
        assignments = sum(sum(c) for c in self.tokens_per_expert)
        tflops = self.flops_per_token * self.tokens / self.seconds / self.devices / 1e12  # per device
        return {
            "step": self.number,
            "phase": self.phase,
            "seq_len": self.seq_len,
            "loss": round(
                self.ce
                + cfg.load_balance_coef * self.load_balancing_sum / n
                + cfg.sequence_balance_coef * self.sequence_balancing_sum / n
                + cfg.router_z_coef * self.router_z_sum / n
                + cfg.logit_z_coef * self.logit_z_sum / n,
                5,
            ),
            "ce": round(self.ce, 5),
            "load_balancing_loss": round(self.load_balancing_sum / n, 5),
            "sequence_balancing_loss": round(self.sequence_balancing_sum / n, 5),
            "router_z_loss": round(self.router_z_sum / n, 5),
            "logit_z_loss": round(self.logit_z_sum / n, 5),
            "grad_norm": round(self.grad_norm, 5),
            "grad_norm_groups": self.grad_norm_groups,
            "lr": self.lr,
            "tokens_per_s": round(self.tokens / self.seconds, 1),
            "tflops": round(tflops, 5),
            "mfu": round(tflops / peak, 5) if peak else None,
            "tokens_per_expert": self.tokens_per_expert,
            "load_imbalance": [round(x, 4) for x in self.imbalance],
            "token_drop_rate": round(self.dropped / assignments, 6) if assignments else 0.0,
        }


def group_of(name: str) -> str:
    return next((g for g, key in PARAM_GROUPS if key in f".{name}"), "other")


def group_grad_norms(model: torch.nn.Module) -> dict[str, float]:
    """Gradient norm per parameter group; one host sync for all of them (one per parameter costs a GPU
    step its queue)."""
    named = [(group_of(name), p.grad) for name, p in model.named_parameters() if p.grad is not None]
    if not named:
        return {}
    squares = torch.stack([g.detach().float().square().sum() for _, g in named]).tolist()
    sums: dict[str, float] = {}
    for (group, _), v in zip(named, squares):
        sums[group] = sums.get(group, 0.0) + v
    return {g: round(math.sqrt(v), 5) for g, v in sorted(sums.items())}


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


def restart_cost(dropped: list[dict], model: Transformer, cfg: TrainConfig) -> dict:
    """What a resume trains again: the steps recorded after its checkpoint (their records dropped), their
    tokens, model FLOPs and wall seconds as recorded. The time a killed step had run before the kill, and the
    restart itself, are not in them."""
    tokens = [cfg.batch_size * r.get("seq_len", cfg.seq_len) for r in dropped]
    return {"recomputed_steps": len(dropped), "recomputed_tokens": sum(tokens),
            "recomputed_flops": sum(model.flops_per_token(r.get("seq_len", cfg.seq_len)) * n
                                    for r, n in zip(dropped, tokens, strict=True)),
            "recomputed_seconds": round(sum(n / r["tokens_per_s"] for r, n in zip(dropped, tokens, strict=True)), 3)}


def _health_by_phase(records: list[dict]) -> list[dict]:
    """Per curriculum phase (its context length): its steps, mean token drop rate and mean load imbalance per
    MoE layer, so a drop or imbalance that grows with the context shows where it starts."""
    phases: dict[int, list[dict]] = {}
    for r in records:
        phases.setdefault(r.get("phase", 0), []).append(r)
    return [{"phase": p, "seq_len": rs[0].get("seq_len"), "steps": len(rs),
             "token_drop_rate": round(float(np.mean([r["token_drop_rate"] for r in rs])), 6),
             "load_imbalance": [round(float(x), 4) for x in np.mean([r["load_imbalance"] for r in rs], axis=0)]}
            for p, rs in phases.items()]


def _median(values: list[float | None]) -> float | None:
    """The median step's figure, rounded as a record's; None when the steps have none (no device peak)."""
    return None if None in values else round(float(np.median(values)), 5)


def _phases(cfg: TrainConfig, records: list[dict]) -> list[dict]:
    """Where each phase of the mix starts (a phase's rows may be longer or shorter than the last's)."""
    return [
        {"phase": r.get("phase", 0), "start_step": r["step"] - 1, "seq_len": r.get("seq_len", cfg.seq_len)}
        for i, r in enumerate(records)
        if i == 0 or r.get("phase") != records[i - 1].get("phase")
    ]


def summarise(
    records: list[dict], model: Transformer, model_cfg: ModelConfig, cfg: TrainConfig, *, vocab: int,
    max_len: int, resumes: list, resumed_from: int | None, alarms: list,
) -> dict:
    """A whole run from its metrics.jsonl records (a resumed run's included)."""
    params = model.num_params()
    losses = [r["ce"] for r in records]
    k = min(10, len(losses))
    head, tail = float(np.mean(losses[:k])), float(np.mean(losses[-k:]))
    last = records[-1]
    step_tokens = [cfg.batch_size * r.get("seq_len", cfg.seq_len) for r in records]
    flops = sum(
        model.flops_per_token(r.get("seq_len", cfg.seq_len)) * n for r, n in zip(records, step_tokens)
    )
    return {
        "steps": cfg.steps,
        "tokens": sum(step_tokens),
        "batch_size": cfg.batch_size,
        "phases": _phases(cfg, records),
        "seq_len": max_len,
        "params_total": params["total"],
        "params_active": params["active"],
        "d_model": model_cfg.d_model,
        "n_layers": model_cfg.n_layers,
        "flops_per_token": model.flops_per_token(max_len),
        "flops": flops,
        "tail_loss": round(ladder.tail_loss(losses), 4),
        "initial_loss": round(head, 4),
        "final_loss": round(tail, 4),
        "loss_fell": tail < head,
        "tokens_per_s": round(float(np.median([r["tokens_per_s"] for r in records])), 1),
        "tflops": round(float(np.median([r["tflops"] for r in records])), 5),
        "mfu": _median([r.get("mfu") for r in records]),
        "peak_grad_norm": max(r["grad_norm"] for r in records),
        "final_load_imbalance": last["load_imbalance"],
        "final_tokens_per_expert": last["tokens_per_expert"],
        "token_drop_rate": round(float(np.mean([r["token_drop_rate"] for r in records])), 6),
        "health_by_phase": _health_by_phase(records),
        "train_seconds": round(sum(n / r["tokens_per_s"] for r, n in zip(records, step_tokens)), 1),
        "steps_outside_ladder_band": sum(bool(r.get("outside_ladder_band")) for r in records),
        "vocab_size": vocab,
        "resumes": resumes,
        "resumed_from_step": resumed_from,
        "alarms": alarms,
        "schedule": cfg.schedule,
        "precision": cfg.precision,
        "distributed": distributed_summary(cfg, records),
    }
