"""Auxiliary MoE losses as pure functions: load balancing (Switch/MegaBlocks form, over the batch or per
sequence) and router z-loss.

Legend: T tokens, E experts, K experts per token, B sequences, S tokens of a sequence.
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


def sequence_balancing_loss(*, probs_TE: torch.Tensor, experts_TK: torch.Tensor, sequences: int) -> torch.Tensor:
    """The load-balancing loss of each sequence's own tokens (the T tokens are `sequences` rows of S), averaged
    over the sequences: DeepSeek-V3's sequence-wise auxiliary loss, mean_b E / (S*K) * sum_e count_be *
    mean_s p_bse, 1.0 when every sequence spreads its tokens evenly. Per sequence, so it needs no other rank's
    counts."""
    num_experts = probs_TE.shape[1]
    probs_BSE = probs_TE.reshape(sequences, -1, num_experts)
    experts_BA = experts_TK.reshape(sequences, -1)  # A = S*K assignments of a sequence
    counts_BE = probs_TE.new_zeros(sequences, num_experts).scatter_add_(
        1, experts_BA, probs_TE.new_ones(experts_BA.shape))
    return (num_experts * (counts_BE * probs_BSE.mean(dim=1)).sum(dim=1) / experts_BA.shape[1]).mean()


def router_z_loss(*, logits_TE: torch.Tensor) -> torch.Tensor:
    """mean_t logsumexp(logits_t)^2: keeps router logits small (ST-MoE).

    Computed in the logits' dtype, as MegaBlocks does by default (`moe_zloss_in_fp32=False`); under
    CUDA autocast logsumexp runs in float32 anyway."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()
