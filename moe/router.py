"""Token-choice top-k router (parameter `router.layer.weight` [E, D], as in MegaBlocks).

With a bias rate (`model.router_bias_rate`, DeepSeek-V3's auxiliary-loss-free balancing) it also holds
`router.expert_bias` [E], a buffer (so checkpoints keep it) added to the probabilities for the choice of
experts only, and moved outside the gradient after each optimizer step (`update_bias`).

Legend: T tokens, D model width, E experts, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Routing:
    logits_TE: torch.Tensor
    probs_TE: torch.Tensor
    weights_TK: torch.Tensor  # routing weights of the chosen experts
    experts_TK: torch.Tensor  # chosen expert ids (int64)


class TopKRouter(nn.Module):
    def __init__(
        self, d_model: int, num_experts: int, top_k: int, *, jitter: float = 0.0, normalize: bool = True,
        bias_rate: float | None = None,
    ):
        super().__init__()
        self.num_experts, self.top_k, self.jitter, self.normalize = num_experts, top_k, jitter, normalize
        self.layer = nn.Linear(d_model, num_experts, bias=False)
        self.bias_rate = bias_rate
        if bias_rate is not None:
            self.register_buffer("expert_bias", torch.zeros(num_experts))

    def forward(self, x_TD: torch.Tensor) -> Routing:
        if self.training and self.jitter > 0:
            x_TD = x_TD * torch.empty_like(x_TD).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        logits_TE = self.layer(x_TD)
        probs_TE = logits_TE.softmax(dim=-1, dtype=torch.promote_types(logits_TE.dtype, torch.float32))
        if self.bias_rate is None:
            weights_TK, experts_TK = probs_TE.topk(self.top_k, dim=-1)
        else:  # the bias picks the experts; their weights are the unbiased probabilities
            experts_TK = (probs_TE + self.expert_bias).topk(self.top_k, dim=-1).indices
            weights_TK = probs_TE.gather(-1, experts_TK)
        # MegaBlocks' convention, top-1 included: a single weight becomes 1.0, and the router then learns
        # from the auxiliary losses only (normalize_expert_weights: false keeps p_max as the weight)
        if self.normalize:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return Routing(logits_TE, probs_TE, weights_TK.to(x_TD.dtype), experts_TK)

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor) -> None:
        """bias_e += rate * sign(mean load - load_e): an expert above the mean load is chosen less often.

        `load_E` counts the step's assignments per expert over every micro-batch and rank, so every rank
        moves its copy the same way."""
        load_E = load_E.float()
        self.expert_bias += self.bias_rate * torch.sign(load_E.mean() - load_E)
