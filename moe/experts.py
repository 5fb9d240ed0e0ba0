"""Experts as one grouped MLP over tokens sorted by expert (MegaBlocks layout: w1, v1, w2 as [E*F, D]).

Legend: T tokens (sorted by expert), D model width, F expert hidden width, E experts.
One entry point, `grouped_linear`, with two paths: `torch.nn.functional.grouped_mm` over the
jagged groups when the shapes meet its 16-byte stride rule, else a loop over unbound experts
(never index `w[e]` per expert: each index's backward writes a full-size gradient).

Autocast has no kernel for `aten::_grouped_mm` (nor for a loop's matmuls over views it did not cast), so
under `train.precision: bf16` the experts would compute in float32 (on CUDA: PyTorch's per-group
fallback, not tensor cores) while attention ran in bf16. `GroupedMLP` casts its input and weights to the
autocast dtype itself, and returns its output in the input's dtype. `matmul_dtypes` records which dtypes
the experts' matmuls ran in (benchmarks/moe_scaling.py and `make gpu-check` report it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


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
        for w in (self.w1, self.v1, self.w2):  # a Transformer re-draws them (moe/model.py, `init_weights`)
            if w is not None:
                nn.init.normal_(w, std=0.02)

    def forward(self, x_TD: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        E, F_, D = self.num_experts, self.hidden, self.d_model
        kind = x_TD.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x_TD.dtype
        x = x_TD.to(dtype)
        w1_EDF, w2 = self.w1.to(dtype).view(E, F_, D).transpose(-2, -1), self.w2.to(dtype).view(E, F_, D)
        offs_E = tokens_per_expert_E.cumsum(0).to(torch.int32)
        # the split sizes cost a host sync: only the loop path (shapes grouped_mm refuses) asks for them
        counts = [] if _grouped_mm_ok(x, w1_EDF) else tokens_per_expert_E.tolist()
        h_TF = grouped_linear(x, w1_EDF, offs_E, counts)
        if self.glu:
            v1 = self.v1.to(dtype).view(E, F_, D)
            h_TF = F.silu(h_TF) * grouped_linear(x, v1.transpose(-2, -1), offs_E, counts)
        else:
            h_TF = F.gelu(h_TF)
        return grouped_linear(h_TF, w2, offs_E, counts).to(x_TD.dtype)


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


MATMULS = frozenset({"mm", "bmm", "addmm", "matmul", "_grouped_mm"})


class _MatmulDtypes(TorchDispatchMode):
    """Below autocast: sees each matmul with the operands it really ran on."""

    def __init__(self, seen: set[str]):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in MATMULS:
            self.seen.add(str(args[0].dtype).removeprefix("torch."))
        return func(*args, **(kwargs or {}))


@contextmanager
def matmul_dtypes(model: nn.Module) -> Iterator[set[str]]:
    """Within the block, the dtypes of the matmuls that `model`'s torch-backend experts run (forward) are
    added to the yielded set: e.g. {'bfloat16'} under bf16 autocast."""
    seen: set[str] = set()
    stack, handles = ExitStack(), []

    def enter(*_):
        stack.enter_context(_MatmulDtypes(seen))

    def leave(*_):
        stack.close()

    for m in model.modules():
        if isinstance(m, GroupedMLP):
            handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    try:
        yield seen
    finally:
        stack.close()
        for h in handles:
            h.remove()
