"""Experts as one grouped MLP over tokens sorted by expert (MegaBlocks layout: w1, v1, w2 as [E*F, D]).

Legend: T tokens (sorted by expert), D model width, F expert hidden width, E experts.
One entry point, `grouped_linear`, with two paths: `torch.nn.functional.grouped_mm` over the
jagged groups when the shapes meet its 16-byte stride rule, else a loop over unbound experts
(never index `w[e]` per expert: each index's backward writes a full-size gradient).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    size = x.element_size()
    return (hasattr(F, "grouped_mm") and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and x.shape[-1] * size % 16 == 0 and w.shape[-1] * size % 16 == 0)


def grouped_linear(
    x_TK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor, counts: list[int]
) -> torch.Tensor:
    """Rows of x in group e (rows offs[e-1]:offs[e]) times w[e]: [T, K] x [E, K, N] -> [T, N]."""
    if _grouped_mm_ok(x_TK, w_EKN):
        return F.grouped_mm(x_TK, w_EKN, offs=offs_E)
    parts = [xe @ we for xe, we in zip(x_TK.split(counts), w_EKN.unbind(0))]
    return torch.cat(parts) if parts else x_TK.new_zeros(0, w_EKN.shape[-1])


class GroupedMLP(nn.Module):
    """Parameter holder named like MegaBlocks' `experts.mlp` so state dicts load into either backend."""

    def __init__(self, num_experts: int, d_model: int, hidden: int, glu: bool):
        super().__init__()
        self.num_experts, self.d_model, self.hidden, self.glu = num_experts, d_model, hidden, glu
        self.w1 = nn.Parameter(torch.empty(num_experts * hidden, d_model))
        self.v1 = nn.Parameter(torch.empty(num_experts * hidden, d_model)) if glu else None
        self.w2 = nn.Parameter(torch.empty(num_experts * hidden, d_model))
        for w in (self.w1, self.v1, self.w2):
            if w is not None:
                nn.init.normal_(w, std=d_model**-0.5)

    def forward(self, x_TD: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        E, F_, D = self.num_experts, self.hidden, self.d_model
        counts = tokens_per_expert_E.tolist()  # host sync: the loop path needs the split sizes
        offs_E = tokens_per_expert_E.cumsum(0).to(torch.int32)
        w1_EDF = self.w1.view(E, F_, D).transpose(-2, -1)
        h_TF = grouped_linear(x_TD, w1_EDF, offs_E, counts)
        if self.glu:
            h_TF = F.silu(h_TF) * grouped_linear(
                x_TD, self.v1.view(E, F_, D).transpose(-2, -1), offs_E, counts
            )
        else:
            h_TF = F.gelu(h_TF)
        return grouped_linear(h_TF, self.w2.view(E, F_, D), offs_E, counts)


class Experts(nn.Module):
    def __init__(self, num_experts: int, d_model: int, hidden: int, glu: bool):
        super().__init__()
        self.mlp = GroupedMLP(num_experts, d_model, hidden, glu)

    def forward(self, x_TD: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        return self.mlp(x_TD, tokens_per_expert_E)


class SharedExpert(nn.Module):
    """The always-on dense path (`shared_expert.up_proj`, `gate_proj` for GLU, `down_proj`)."""

    def __init__(self, d_model: int, hidden: int, glu: bool):
        super().__init__()
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.gate_proj = nn.Linear(d_model, hidden, bias=False) if glu else None
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        h = self.up_proj(x_TD)
        h = F.silu(self.gate_proj(x_TD)) * h if self.gate_proj is not None else F.gelu(h)
        return self.down_proj(h)
