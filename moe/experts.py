"""Experts as one grouped MLP over tokens sorted by expert (MegaBlocks layout: w1, v1, w2 as [E*F, D]).

Legend: T tokens (sorted by expert), D model width, F expert hidden width, E experts.
On the CPU, from `LOOP_FROM_ROWS` assignments a call (below it, grouped_mm is faster there too), `_ExpertLoop`
runs each expert's rows through its whole MLP, forward and backward. It saves
the rows and the two pre-activations only (autograd over the grouped path kept five [T, F] tensors; at
16,384 tokens the extra allocations cost ~10% of a layer pass in page faults, benchmarks/README.md) and
writes each weight gradient once, in place. With several intra-op threads the experts run in parallel, each
on one thread (`_each_expert`): split across threads, each expert's small matmuls and activations waited
for every thread at every op, 8x more waits at 64 experts than at 8 (benchmarks/README.md, moe_scaling).
Elsewhere (CUDA, and the CPU below `LOOP_FROM_ROWS`) `grouped_linear` has two paths:
`torch.nn.functional.grouped_mm` over the jagged groups when the shapes meet its 16-byte stride rule, else
a loop over unbound experts (never index `w[e]` per expert: each index's backward writes a full-size
gradient). Both compute the same products in the same order: on the CPU the outputs and gradients are
those of the grouped_mm path (tests/test_moe.py compares them). The first CPU pass has glibc keep freed
memory (`keep_freed_memory`): large weight gradients are reused, not faulted in afresh each pass.

Autocast has no kernel for `aten::_grouped_mm` (nor for a loop's matmuls over views it did not cast), so
under `train.precision: bf16` the experts would compute in float32 (on CUDA: PyTorch's per-group
fallback, not tensor cores) while attention ran in bf16. `GroupedMLP` casts its input and weights to the
autocast dtype itself, and returns its output in the input's dtype. `matmul_dtypes` records which dtypes
the experts' matmuls ran in (benchmarks/moe_scaling.py and `make gpu-check` report it).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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


def _rows(t: torch.Tensor | None, cuts: torch.Tensor) -> list[torch.Tensor | None]:
    """Each expert's block of rows (views; `cuts`: where blocks 1.. start); None for each without a tensor."""
    return [None] * (len(cuts) + 1) if t is None else list(t.tensor_split(cuts))


def _each(w: torch.Tensor | None, n: int) -> list[torch.Tensor | None]:
    """Each expert's [F, D] weight (views) of an [E, F, D] tensor; None for each without one."""
    return [None] * n if w is None else list(w.unbind(0))


def _glu_backward(x, dy, h1, h2, dx, w1, v1, w2, dw1, dv1, dw2) -> None:
    """One expert's block, as autograd differentiates mm(silu(x w1^T) * (x v1^T), w2)."""
    act = F.silu(h1)
    torch.mm((act * h2).T, dy, out=dw2)
    da = dy @ w2.T
    dh2 = da * act
    dh1 = torch.ops.aten.silu_backward(da * h2, h1)
    torch.mm(dh2.T, x, out=dv1)
    torch.mm(dh1.T, x, out=dw1)
    torch.add(dh1 @ w1, dh2 @ v1, out=dx)  # two products, then one sum: autograd's order for x's two uses


def _mlp_backward(x, dy, h1, h2, dx, w1, v1, w2, dw1, dv1, dw2) -> None:
    """One expert's block, as autograd differentiates mm(gelu(x w1^T), w2) (h2, v1, dv1: None)."""
    torch.mm(F.gelu(h1).T, dy, out=dw2)
    dh1 = torch.ops.aten.gelu_backward(dy @ w2.T, h1)
    torch.mm(dh1.T, x, out=dw1)
    torch.mm(dh1, w1, out=dx)


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


@functools.cache
def keep_freed_memory() -> bool:
    """Have glibc keep the memory this process frees for its next allocations (once per process; False
    where the C library is not glibc). By default glibc maps each block of 32 MiB or more on its own and
    unmaps it when freed, so every CPU backward pass of a 64-expert layer faulted its three 32 MiB weight
    gradients in afresh, zeroed page by page (24,579 faults a pass at 4,096 tokens, benchmarks/README.md).
    No block is mapped on its own (M_MMAP_MAX 0) and up to 1 GiB of free heap top is kept (M_TRIM_THRESHOLD):
    the process holds its peak memory for reuse instead of returning it. Child processes are unaffected."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))


def _one_thread() -> None:
    """A pool thread's start: its ATen and MKL work runs on this thread alone (OpenMP and MKL keep the count
    per thread; `torch.set_num_threads` would change it for the whole process)."""
    torch.get_num_threads()  # ATen sets this thread's count on first use: let it, then override
    lib = ctypes.CDLL(torch._C.__file__)  # libgomp and MKL are among its dependencies
    lib.omp_set_num_threads(1)
    lib.mkl_set_num_threads_local(ctypes.byref(ctypes.c_int(1)))  # MKL's Fortran-style entry: by reference


@functools.cache
def _threads_settable() -> bool:
    """Whether `_one_thread` can work here: ATen on OpenMP with MKL, both reachable from torch._C."""
    if not (torch.backends.openmp.is_available() and torch.backends.mkl.is_available()):
        return False
    try:
        lib = ctypes.CDLL(torch._C.__file__)
        return bool(lib.omp_set_num_threads and lib.mkl_set_num_threads_local)
    except (OSError, AttributeError):
        return False


@functools.cache
def _pool(pid: int, threads: int) -> ThreadPoolExecutor:
    """The expert threads of process `pid` (a forked child gets its own: threads do not survive a fork)."""
    return ThreadPoolExecutor(threads, thread_name_prefix="experts", initializer=_one_thread)


def _deal(rows: list[int], threads: int) -> list[list[int]]:
    """Experts dealt to threads for about equal rows each: the largest first, each to the least loaded."""
    shares, load = [[] for _ in range(threads)], [0] * threads
    for e in sorted(range(len(rows)), key=rows.__getitem__, reverse=True):
        t = load.index(min(load))
        shares[t].append(e)
        load[t] += rows[e]
    return [s for s in shares if s]


def _each_expert(run, blocks: list[tuple]) -> None:
    """`run(*block)` for each expert's block of views. With several intra-op threads the experts run in
    parallel, each on one thread: one wait a pass, not one per op, and the bits of a one-thread run. In turn
    on the calling thread under one thread, or under a torch function or dispatch mode (a mode sees the ops
    of its own thread only: `matmul_dtypes`)."""
    threads = torch.get_num_threads()
    modes = torch._C._len_torch_function_stack() + torch._C._len_torch_dispatch_stack()
    if threads == 1 or len(blocks) < threads or modes or not _threads_settable():
        for block in blocks:
            run(*block)
        return
    inference = torch.is_inference_mode_enabled()

    def share(experts: list[int]) -> None:
        with torch.inference_mode(inference), torch.no_grad():  # grad modes are per thread: the caller's
            for e in experts:
                run(*blocks[e])

    pool = _pool(os.getpid(), threads)
    for done in [pool.submit(share, s) for s in _deal([b[0].shape[0] for b in blocks], threads)]:
        done.result()


def _glu_forward(x, h1, h2, y, w1, v1, w2) -> None:
    """One expert's block: y = mm(silu(x w1^T) * (x v1^T), w2), keeping the pre-activations h1, h2."""
    torch.mm(x, w1.T, out=h1)
    torch.mm(F.silu(h1) * torch.mm(x, v1.T, out=h2), w2, out=y)


def _mlp_forward(x, h1, h2, y, w1, v1, w2) -> None:
    """One expert's block: y = mm(gelu(x w1^T), w2), keeping the pre-activation h1."""
    torch.mm(x, w1.T, out=h1)
    torch.mm(F.gelu(h1), w2, out=y)


class _ExpertLoop(torch.autograd.Function):
    """[A, D] rows sorted by expert -> [A, D]; w1, v1 (None without GLU), w2 as [E, F, D]; `cuts` [E - 1]: the
    rows where experts 1.. start, a CPU tensor (tensor_split reads it in C++: the layer's host reads stay one
    per micro-batch, tests/test_numerics.py). Saves the rows and the pre-activations (h1, h2), not the
    activations: the backward recomputes them."""

    @staticmethod
    def forward(ctx, x, w1, v1, w2, cuts: torch.Tensor):
        h1, y = x.new_empty(x.shape[0], w1.shape[1]), torch.empty_like(x)
        h2, n = (None if v1 is None else torch.empty_like(h1)), w1.shape[0]
        rows = zip(*(_rows(t, cuts) for t in (x, h1, h2, y)))
        weights = zip(w1.unbind(0), _each(v1, n), w2.unbind(0))
        _each_expert(_mlp_forward if v1 is None else _glu_forward, [r + w for r, w in zip(rows, weights)])
        ctx.save_for_backward(x, w1, v1, w2, h1, h2, cuts)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w1, v1, w2, h1, h2, cuts = ctx.saved_tensors
        n = w1.shape[0]
        dx, dw1, dw2 = torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w2)
        dv1 = None if v1 is None else torch.empty_like(v1)
        rows = zip(*(_rows(t, cuts) for t in (x, dy, h1, h2, dx)))
        weights = zip(w1.unbind(0), _each(v1, n), w2.unbind(0), dw1.unbind(0), _each(dv1, n), dw2.unbind(0))
        _each_expert(_mlp_backward if v1 is None else _glu_backward, [r + w for r, w in zip(rows, weights)])
        return dx, dw1, dv1, dw2, None


# On the CPU the per-expert loop takes over from grouped_mm at this many assignments (rows) a layer call: below
# it torch's CPU grouped_mm (2.13) is faster, above it the loop's one-thread-per-expert (benchmarks/README.md,
# vs_transformers.py; measured on 2 threads, fp32, 8 and 64 experts, at 2k-32k rows)
LOOP_FROM_ROWS = 16384


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
        if x_TD.is_cpu:  # a query of the device, not a pin: tests/test_device.py
            keep_freed_memory()
        if x_TD.is_cpu and x_TD.shape[0] >= LOOP_FROM_ROWS:  # the per-expert loop
            v1 = None if self.v1 is None else self.v1.to(dtype).view(E, F_, D)
            with torch.autocast(kind, enabled=False):  # the operands are cast already: nothing for it to recast
                y = _ExpertLoop.apply(x, self.w1.to(dtype).view(E, F_, D), v1, self.w2.to(dtype).view(E, F_, D),
                                      tokens_per_expert_E.cumsum(0)[:-1])
            return y.to(x_TD.dtype)
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
