"""Test support: MegaBlocks' real Python layers (megablocks 0.10.0) on CPU, their kernels as torch ops.

It serves the `model.backend: megablocks` tests on machines without a GPU (tests/test_megablocks.py).
`install()` must run before `import megablocks`. It puts three things in place:
  * `megablocks_ops` (the CUDA extension MegaBlocks compiles only on a CUDA machine): sort, histogram,
    exclusive/inclusive cumsum, replicate forward/backward, as torch ops writing into the given outputs;
  * `grouped_gemm` (CUDA-only): `backend.gmm` and the autograd `ops.gmm`, the same structure as
    grouped_gemm 0.3.0's own `ops.GroupedGemm`;
  * `megablocks.backend.kernels` (Triton): gather, scatter, their padded and binned variants and wgrads,
    rewritten with index ops. MegaBlocks' own autograd.Functions in `megablocks.ops` stay in use.
If `triton` is not installed (or `stub_triton=True`), a no-op stand-in module is registered so that the
modules declaring Triton kernels import (then it leaves sys.modules); none of those kernels is launched.
Precision: the Triton kernels multiply (and wgrads accumulate) in float32, so on a GPU a float64 layer is
rounded to float32 there; here everything runs in the tensors' own dtype (for float32/bf16/fp16 the same
values up to summation order), which is what makes float64 parity with the torch layer exact.
Not covered: the sparse path (`mlp_impl='sparse'`, stk's Triton matmuls; `indices` raises).
`GMM_BF16_ONLY = True` makes gmm refuse non-bf16 operands as the real CUDA op does (it has no autocast).
`fake_cuda()`: `torch.cuda.is_available()` reads True and `current_device()` gives "cpu" inside it, for
code that insists on CUDA while building the layer (moeflow's MegaBlocksMoE).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types

import torch

__all__ = ["install", "fake_cuda", "register_triton_stub", "GMM_BF16_ONLY"]


# ---- megablocks_ops (csrc/*.h): the ops fill the `out` tensors they are given ----------------------------
def _sort(x, end_bit, x_out, iota_out):  # stable radix sort on bits [0, end_bit), values = positions
    key = x & ((1 << end_bit) - 1) if end_bit < x.element_size() * 8 else x
    order = torch.sort(key, stable=True).indices
    x_out.copy_(x[order])
    iota_out.copy_(order)


def _histogram(x, num_bins):  # int32 counts of 0..num_bins-1 (others ignored), per row if 2-D
    counts = (x.unsqueeze(-1) == torch.arange(num_bins, device=x.device)).sum(-2)
    return counts.to(torch.int32)


def _inclusive_cumsum(x, dim, out):
    out.copy_(x.cumsum(dim))


def _exclusive_cumsum(x, dim, out):
    out.copy_(x.cumsum(dim) - x)


def _replicate_forward(x, bins, out):  # out[:, bins[i-1]:bins[i]] = x[:, i]
    out.copy_(x.repeat_interleave(torch.diff(bins, prepend=bins.new_zeros(1)).long(), dim=1))


def _replicate_backward(grad, bins, out):  # segmented sum, the transpose of the above
    seg = torch.repeat_interleave(torch.diff(bins, prepend=bins.new_zeros(1)).long())
    out.zero_().index_add_(1, seg, grad)


def _indices(*args):
    raise NotImplementedError("megablocks cpu shim: the sparse mlp_impl (stk/Triton) is not supported")


# ---- grouped_gemm: c = per-group a_e @ b_e over row groups of a (batch_sizes, int64 on CPU) ---------------
GMM_BF16_ONLY = False  # True: refuse what grouped_gemm 0.3.0's CUDA op refuses (a, b, c not all bfloat16)


def _gmm(a, b, batch_sizes, trans_a=False, trans_b=False, c=None):
    assert not (trans_a and trans_b)
    if GMM_BF16_ONLY and {a.dtype, b.dtype, (a if c is None else c).dtype} != {torch.bfloat16}:
        raise RuntimeError(f"grouped_gemm takes bfloat16 only (csrc/grouped_gemm.cu): a {a.dtype}, "
                           f"b {b.dtype}")
    sizes = batch_sizes.tolist()
    if trans_a:  # a [T, M], b [T, N] -> [E, M, N]: the weight gradient
        out = torch.stack([ae.t() @ be for ae, be in zip(a.split(sizes), b.split(sizes))])
    else:  # a [T, K], b [E, K, N] (or [E, N, K] with trans_b) -> [T, N]
        out = torch.cat([ae @ (be.t() if trans_b else be) for ae, be in zip(a.split(sizes), b.unbind(0))])
    return out if c is None else c.copy_(out)


class _GroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, batch_sizes, trans_b):
        ctx.save_for_backward(a, b, batch_sizes)
        ctx.trans_b = trans_b
        return _gmm(a, b, batch_sizes, trans_b=trans_b)

    @staticmethod
    def backward(ctx, grad):
        a, b, batch_sizes = ctx.saved_tensors
        agrad = bgrad = None
        if ctx.needs_input_grad[0]:
            agrad = _gmm(grad, b, batch_sizes, trans_b=not ctx.trans_b)
        if ctx.needs_input_grad[1]:
            lhs, rhs = (grad, a) if ctx.trans_b else (a, grad)
            bgrad = _gmm(lhs, rhs, batch_sizes, trans_a=True)
        return agrad, bgrad, None, None


def _ops_gmm(a, b, batch_sizes, trans_b=False):
    return _GroupedGemm.apply(a, b, batch_sizes, trans_b)


# ---- megablocks.backend.kernels: sorted assignment i holds token-slot indices[i] (token = slot // top_k)
def _padded_rows(bin_ids, bins, padded_bins):  # row of each sorted assignment in the padded buffer
    b = bin_ids.long()
    start = bins.long() - torch.diff(bins.long(), prepend=bins.new_zeros(1).long())
    pstart = padded_bins.long() - torch.diff(padded_bins.long(), prepend=padded_bins.new_zeros(1).long())
    return torch.arange(b.numel(), device=b.device) - start[b] + pstart[b]


def _scaled(rows, weights, slots):
    return rows if weights is None else rows * weights[slots].unsqueeze(1)


def padded_gather(x, indices, bin_ids, weights, bins, padded_bins, top_k):
    slots = indices.long()
    out = x.new_zeros(int(padded_bins[-1]), x.shape[1])
    out[_padded_rows(bin_ids, bins, padded_bins)] = _scaled(x[slots // top_k], weights, slots)
    return out


def gather(x, indices, bin_ids, weights, bins, top_k):
    slots = indices.long()
    out = x.new_zeros(x.shape[0] * top_k, x.shape[1])
    out[_padded_rows(bin_ids, bins, bins)] = _scaled(x[slots // top_k], weights, slots)
    return out


def padded_scatter(x, indices, bin_ids, weights, bins, padded_bins, top_k):
    slots, tokens = indices.long(), indices.shape[0] // top_k
    out = x.new_zeros(tokens * top_k, x.shape[1])
    out[slots] = _scaled(x[_padded_rows(bin_ids, bins, padded_bins)], weights, slots)
    out = out.view(tokens, top_k, x.shape[1])
    return out.sum(dim=1) if top_k > 1 else out.view(tokens, x.shape[1])


def scatter(x, indices, bin_ids, weights, bins, top_k):
    return padded_scatter(x, indices, bin_ids, weights, bins, bins, top_k)


def padded_scatter_wgrad(x, grad, indices, bin_ids, bins, padded_bins, top_k):
    slots = indices.long()
    out = x.new_zeros(indices.shape[0])
    out[slots] = (x[_padded_rows(bin_ids, bins, padded_bins)] * grad[slots // top_k]).sum(-1)
    return out


def scatter_wgrad(x, grad, indices, bin_ids, bins, top_k):
    return padded_scatter_wgrad(x, grad, indices, bin_ids, bins, bins, top_k)


def _binned_slots(indices, bins, capacity):  # kept (expert, entry, slot) of each sorted assignment
    i = torch.arange(indices.numel(), device=indices.device)
    expert = torch.searchsorted(bins.long(), i, right=True)
    entry = i - (bins.long() - torch.diff(bins.long(), prepend=bins.new_zeros(1).long()))[expert]
    keep = entry < capacity
    return expert[keep], entry[keep], indices.long()[keep]


def binned_gather(x, indices, weights, bins, expert_capacity, top_k):
    out = x.new_zeros(bins.shape[0], expert_capacity, x.shape[1])
    expert, entry, slots = _binned_slots(indices, bins, expert_capacity)
    out[expert, entry] = _scaled(x[slots // top_k], weights, slots)
    return out


def binned_scatter(x, indices, weights, bins, top_k):
    tokens, hidden = indices.shape[0] // top_k, x.shape[2]
    out = x.new_zeros(tokens * top_k, hidden)
    expert, entry, slots = _binned_slots(indices, bins, x.shape[1])
    out[slots] = _scaled(x[expert, entry], weights, slots)
    out = out.view(tokens, top_k, hidden)
    return out.sum(dim=1) if top_k > 1 else out.view(tokens, hidden)


def binned_scatter_wgrad(x, grad, indices, bins, top_k):
    out = x.new_zeros(indices.shape[0])
    expert, entry, slots = _binned_slots(indices, bins, x.shape[1])
    out[slots] = (x[expert, entry] * grad[slots // top_k]).sum(-1)
    return out


_KERNELS = ("gather", "scatter", "scatter_wgrad", "padded_gather", "padded_scatter", "padded_scatter_wgrad",
            "binned_gather", "binned_scatter", "binned_scatter_wgrad")


# ---- module registration ---------------------------------------------------------------------------------
def _module(name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    mod.__shim__ = True
    return mod


class _Anything:
    """Stands in for any Triton object: callable, subscriptable, usable as a decorator or annotation."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else _Anything()

    def __getattr__(self, name):
        return _Anything()

    def __getitem__(self, key):
        return _Anything()


def register_triton_stub() -> None:
    """Register a no-op `triton` (and `triton.language`) in sys.modules."""
    def module_getattr(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    triton = _module("triton", __version__="0.0.0+megablocks-cpu-shim", __path__=[],
                     __getattr__=module_getattr)
    language = _module("triton.language", __getattr__=module_getattr)
    triton.language = language
    sys.modules.update({"triton": triton, "triton.language": language})


def install(stub_triton: bool | None = None, grouped_gemm: bool = True) -> None:
    """Register the torch kernels; idempotent. Call before importing megablocks.

    `grouped_gemm=False` leaves grouped_gemm missing (as on a machine where it did not build)."""
    if stub_triton is None:
        stub_triton = "triton" not in sys.modules and importlib.util.find_spec("triton") is None
    if stub_triton and "megablocks.backend.kernels" not in sys.modules:
        register_triton_stub()
    sys.modules.setdefault("megablocks_ops", _module(
        "megablocks_ops", sort=_sort, histogram=_histogram, inclusive_cumsum=_inclusive_cumsum,
        exclusive_cumsum=_exclusive_cumsum, replicate_forward=_replicate_forward,
        replicate_backward=_replicate_backward, indices=_indices))
    if grouped_gemm and "grouped_gemm" not in sys.modules:
        backend, ops = _module("grouped_gemm.backend", gmm=_gmm), _module("grouped_gemm.ops", gmm=_ops_gmm)
        sys.modules.update({"grouped_gemm": _module("grouped_gemm", backend=backend, ops=ops),
                            "grouped_gemm.backend": backend, "grouped_gemm.ops": ops})
    import megablocks.grouped_gemm_util as ggu  # may have been imported before install(): set its globals

    if grouped_gemm:
        gg = sys.modules["grouped_gemm"]
        ggu._grouped_gemm_is_available, ggu.backend, ggu.ops = True, gg.backend, gg.ops
    import megablocks.backend.kernels as kernels

    for name in _KERNELS:
        setattr(kernels, name, globals()[name])
    if getattr(sys.modules.get("triton"), "__shim__", False):
        # megablocks holds its references; hide the stand-in from torch's find_spec("triton")
        del sys.modules["triton"], sys.modules["triton.language"]


@contextlib.contextmanager
def fake_cuda():
    """torch.cuda.is_available() -> True and current_device() -> 'cpu' inside the block, restored after."""
    saved = torch.cuda.is_available, torch.cuda.current_device
    torch.cuda.is_available, torch.cuda.current_device = (lambda: True), (lambda: "cpu")
    try:
        yield
    finally:
        torch.cuda.is_available, torch.cuda.current_device = saved
