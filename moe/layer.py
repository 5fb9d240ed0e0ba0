"""The MoE layer: route, sort token-expert assignments by expert, run the experts, scatter back weighted.

Legend: T tokens, D model width, E experts, K experts per token, A = T*K assignments.
Dropless by default: every (token, expert) assignment is computed. With `capacity_factor` set, each
expert keeps its first ceil(cf * A / E) assignments in token order and drops the rest (their
contribution is zero) while training; the drop rate is reported, for comparison with the dropless layer.
In evaluation (`model.eval()`) the layer is dropless whatever the factor: a token's score must not depend
on which other tokens share its batch.
`moe/backend.py` picks the backend: this reference, or MegaBlocks' dMoE on CUDA.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moeflow.configs import ModelConfig
from moeflow.moe.experts import Experts, SharedExpert
from moeflow.moe.losses import load_balancing_loss, router_z_loss, sequence_balancing_loss
from moeflow.moe.router import TopKRouter


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k, self.capacity_factor = cfg.num_experts, cfg.top_k, cfg.capacity_factor
        self.router = TopKRouter(cfg.d_model, cfg.num_experts, cfg.top_k, jitter=cfg.router_jitter,
                                 normalize=cfg.normalize_expert_weights, bias_rate=cfg.router_bias_rate)
        self.experts = Experts(cfg.num_experts, cfg.d_model, cfg.expert_hidden, cfg.glu)
        self.shared_expert = (
            SharedExpert(cfg.d_model, cfg.shared_expert_hidden, cfg.glu) if cfg.shared_expert_hidden else None
        )
        self.world = None  # under torchrun: the `parallel.World` (experts split across ranks, global counts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """x [B, S, D] or [T, D] (one sequence) -> (y shaped as x, aux losses and metrics of this call)."""
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        r = self.router(x_TD)
        experts_A = r.experts_TK.reshape(-1)
        order_A = experts_A.argsort(stable=True)  # stable: within an expert, assignments stay in token order
        # a scatter, not bincount: CUDA's bincount reads the largest id back to the host to size its output
        routed_E = experts_A.new_zeros(self.num_experts).scatter_add_(0, experts_A, torch.ones_like(experts_A))
        tokens_per_expert_E = routed_E
        if self.capacity_factor is not None and self.training:
            capacity = math.ceil(self.capacity_factor * experts_A.numel() / self.num_experts)
            start_E = routed_E.cumsum(0) - routed_E
            rank_A = torch.arange(order_A.numel(), device=x.device) - start_E[experts_A[order_A]]
            order_A = order_A[rank_A < capacity]
            tokens_per_expert_E = routed_E.clamp(max=capacity)
        token_A = order_A // self.top_k  # which token each sorted assignment belongs to
        if self.world is not None and self.world.expert_parallel:
            y_AD = self.world.dispatch(x_TD[token_A], tokens_per_expert_E, self.experts)
        else:
            y_AD = self.experts(x_TD[token_A], tokens_per_expert_E)
        y_AD = y_AD * r.weights_TK.reshape(-1)[order_A].unsqueeze(-1)
        out_TD = torch.zeros_like(x_TD).index_add_(0, token_A, y_AD)
        if self.shared_expert is not None:
            out_TD = out_TD + self.shared_expert(x_TD)
        counts_E = (
            routed_E if self.world is None else self.world.global_counts(routed_E)
        )  # every rank's tokens
        aux = {
            "load_balancing_loss": load_balancing_loss(probs_TE=r.probs_TE, tokens_per_expert_E=counts_E),
            "sequence_balancing_loss": sequence_balancing_loss(
                probs_TE=r.probs_TE, experts_TK=r.experts_TK, sequences=shape[0] if len(shape) > 2 else 1),
            "router_z_loss": router_z_loss(logits_TE=r.logits_TE),
            "tokens_per_expert": counts_E.detach(),
            "dropped": (routed_E - tokens_per_expert_E).sum().detach(),
        }
        return out_TD.reshape(shape), aux
