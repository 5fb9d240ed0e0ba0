"""Auxiliary MoE losses as pure functions: load balancing (Switch/MegaBlocks form) and router z-loss.

Legend: T tokens, E experts, K experts per token.
"""

from __future__ import annotations

import torch


def load_balancing_loss(*, probs_TE: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """E / (T*K) * sum_e count_e * mean_t p_te: 1.0 when routing is perfectly uniform.

    T*K is the sum of the counts, so counts summed over data-parallel ranks give each rank the share
    of the global loss whose mean over ranks is the loss of the whole batch (and so is its gradient)."""
    num_experts = probs_TE.shape[1]
    counts_E = tokens_per_expert_E.to(probs_TE.dtype)  # the sum stays on the device: no host sync
    return num_experts * torch.dot(counts_E, probs_TE.mean(dim=0)) / counts_E.sum()


def router_z_loss(*, logits_TE: torch.Tensor) -> torch.Tensor:
    """mean_t logsumexp(logits_t)^2: keeps router logits small (ST-MoE).

    Computed in the logits' dtype, as MegaBlocks does by default (`moe_zloss_in_fp32=False`); under
    CUDA autocast logsumexp runs in float32 anyway."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()
