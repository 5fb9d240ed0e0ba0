"""The dropless MoE layer: route, sort token-expert pairs by expert, run the experts, scatter back weighted.

Legend: T tokens, D model width, E experts, K experts per token, A = T*K assignments.
No token is ever dropped: every (token, expert) assignment is computed.
"""

from __future__ import annotations

import torch
from torch import nn

from moeflow.configs import ModelConfig
from moeflow.moe.experts import Experts, SharedExpert
from moeflow.moe.losses import load_balancing_loss, router_z_loss
from moeflow.moe.router import TopKRouter


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.backend != "torch":
            raise NotImplementedError(
                f"model.backend={cfg.backend!r}: only the pure-PyTorch reference exists yet (issue #8 adds MegaBlocks)"
            )
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.router = TopKRouter(cfg.d_model, cfg.num_experts, cfg.top_k)
        self.experts = Experts(cfg.num_experts, cfg.d_model, cfg.expert_hidden, cfg.glu)
        self.shared_expert = SharedExpert(cfg.d_model, cfg.shared_expert_hidden, cfg.glu) if cfg.shared_expert_hidden else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """x [..., D] -> (y [..., D], aux losses and metrics of this call)."""
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        r = self.router(x_TD)
        experts_A = r.experts_TK.reshape(-1)
        order_A = experts_A.argsort(stable=True)
        token_A = order_A // self.top_k  # which token each sorted assignment belongs to
        tokens_per_expert_E = torch.bincount(experts_A, minlength=self.num_experts)
        y_AD = self.experts(x_TD[token_A], tokens_per_expert_E)
        y_AD = y_AD * r.weights_TK.reshape(-1)[order_A].unsqueeze(-1)
        out_TD = torch.zeros_like(x_TD).index_add_(0, token_A, y_AD)
        if self.shared_expert is not None:
            out_TD = out_TD + self.shared_expert(x_TD)
        aux = {
            "load_balancing_loss": load_balancing_loss(
                probs_TE=r.probs_TE, tokens_per_expert_E=tokens_per_expert_E, top_k=self.top_k
            ),
            "router_z_loss": router_z_loss(logits_TE=r.logits_TE),
            "tokens_per_expert": tokens_per_expert_E.detach(),
        }
        return out_TD.reshape(shape), aux
