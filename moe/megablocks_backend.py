"""The MegaBlocks backend: `megablocks.layers.dmoe.dMoE` behind the reference layer's interface (CUDA).

Imported only when `model.backend: megablocks` is selected. The wrapper builds the reference layer
(so both backends draw the same initial weights from the same seed), builds dMoE on the meta device and
hands it the reference layer's parameter tensors. The dMoE object is kept out of `_modules`: its router
and experts are registered once, under the reference layer's names and in its order, so a Transformer's
state dict has the same keys, shapes and order with either backend (`router.layer.weight` [E, D];
`experts.mlp.w1`, `v1`, `w2` [E*F, D]; `shared_expert.*`) and loads strictly into either, optimizer
state included (checkpoints keep it by parameter index). The auxiliary losses and metrics come
from the logits, scores and expert choices dMoE's own router produced in that call (forward hooks);
MegaBlocks' loss globals stay off (moe_loss_weight=0, moe_zloss_weight=0).

grouped_gemm's CUDA op takes bfloat16 operands only. The experts run MegaBlocks' memory-optimized
grouped MLP, whose autograd function casts its input and weights to the CUDA autocast dtype, so fp32
master weights train under `train.precision: bf16`; fp32 training on CUDA is refused at the first
forward. Without a GPU, tests/megablocks_shim.py runs these layers on CPU with torch kernels
(tests/test_megablocks.py); the CUDA-only branches here (`_cuda_dtype_guard`) have not run on a GPU.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.configs import ModelConfig
from moeflow.moe.layer import MoE
from moeflow.moe.losses import load_balancing_loss, router_z_loss, sequence_balancing_loss

INSTALL = (
    "on a CUDA machine, against the torch already installed: pip install --no-build-isolation --no-deps "
    "megablocks==0.10.0 stanford-stk==0.7.1 grouped_gemm==0.3.0 (see README, 'GPU backend')"
)
# Devices whose grouped GEMM takes bf16 only (grouped_gemm 0.3.0's CUDA kernels); a module global so
# that the CPU tests can exercise the guard.
BF16_ONLY_DEVICES = ("cuda",)


def _megablocks():
    """(Arguments, dMoE), or one RuntimeError naming the install command whatever piece is missing."""
    try:  # here, not at the top: megablocks is optional and CUDA-only; the torch backend never needs it
        from megablocks import grouped_gemm_util  # optional: MegaBlocks' Python layers, on CUDA its kernels
        from megablocks.layers.arguments import Arguments
        from megablocks.layers.dmoe import dMoE
    except ImportError as e:  # megablocks itself, its CUDA extension `megablocks_ops`, stk, triton
        raise RuntimeError(
            f"model.backend=megablocks: cannot import megablocks ({e!r}); {INSTALL}"
        ) from None
    if not grouped_gemm_util.grouped_gemm_is_available():  # else Arguments(mlp_impl='grouped') asserts
        raise RuntimeError(f"model.backend=megablocks: grouped_gemm is not installed; {INSTALL}")
    return Arguments, dMoE


class MegaBlocksMoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not torch.cuda.is_available():
            raise RuntimeError("model.backend=megablocks needs CUDA; use backend: torch on this machine")
        Arguments, dMoE = _megablocks()
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        ref = MoE(cfg)  # the torch backend's layer: the same initial weights, drawn in the same order
        args = Arguments(
            hidden_size=cfg.d_model,
            ffn_hidden_size=cfg.expert_hidden,
            moe_num_experts=cfg.num_experts,
            moe_top_k=cfg.top_k,
            mlp_type="glu" if cfg.glu else "mlp",
            mlp_impl="grouped",
            memory_optimized_mlp=True,  # casts x and the weights to the autocast dtype (bf16 on CUDA)
            activation_fn=F.silu if cfg.glu else F.gelu,
            bias=False,
            return_bias=False,
            fp16=False,
            bf16=False,
            moe_normalize_expert_weights=1.0 if cfg.normalize_expert_weights else None,
            moe_jitter_eps=cfg.router_jitter or None,
            moe_loss_weight=0.0,  # the losses are computed here, from the router's outputs
            moe_zloss_weight=0.0,
            device="meta",  # no memory, no random draws: the weights are the reference layer's
        )
        dmoe = dMoE(args)
        routed = {k: v for k, v in ref.state_dict().items() if not k.startswith("shared_expert.")}
        dmoe.load_state_dict(routed, strict=True, assign=True)  # the same tensors, no copy
        # and in the same order (MegaBlocks registers w1, w2, v1): the optimizer state is saved by index
        mlp, order = dmoe.experts.mlp, [n for n, _ in ref.experts.mlp.named_parameters()]
        order += [n for n in mlp._parameters if n not in order]
        mlp._parameters = {n: mlp._parameters[n] for n in order}
        # One registration: dMoE stays out of _modules; its router and experts are this layer's.
        object.__setattr__(self, "dmoe", dmoe)
        self.router, self.experts = dmoe.router, dmoe.experts
        self.shared_expert = ref.shared_expert
        owned = {id(t) for t in [*self.router.parameters(), *self.experts.parameters()]}
        if {id(t) for t in [*dmoe.parameters(), *dmoe.buffers()]} != owned:
            raise RuntimeError("dMoE holds tensors outside its router and experts (unregistered here)")

    def train(self, mode: bool = True) -> MegaBlocksMoE:
        self.dmoe.training = mode  # its children (router, experts) are ours and follow anyway
        return super().train(mode)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        seen: dict[str, torch.Tensor] = {}

        def logits_hook(module, inputs, out):
            seen["logits"] = out

        def router_hook(module, inputs, out):
            seen["scores"], _, seen["experts"] = out

        hooks = (self.router.layer.register_forward_hook(logits_hook),
                 self.router.register_forward_hook(router_hook))
        try:
            with self._cuda_dtype_guard(x_TD):
                out_TD = self.dmoe(x_TD.unsqueeze(1)).squeeze(1)  # dMoE takes [sequence, batch, hidden]
        finally:
            for h in hooks:
                h.remove()
        if not torch.is_autocast_enabled(x.device.type):
            out_TD = out_TD.to(x.dtype)  # bf16 experts of fp32 inference on CUDA (see _cuda_dtype_guard)
        out = out_TD.reshape(shape)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        tokens_per_expert_E = torch.bincount(seen["experts"].reshape(-1), minlength=self.num_experts)
        return out, {
            "load_balancing_loss": load_balancing_loss(
                probs_TE=seen["scores"], tokens_per_expert_E=tokens_per_expert_E
            ),
            "sequence_balancing_loss": sequence_balancing_loss(
                probs_TE=seen["scores"], experts_TK=seen["experts"], sequences=shape[0] if len(shape) > 2 else 1),
            "router_z_loss": router_z_loss(logits_TE=seen["logits"]),
            "tokens_per_expert": tokens_per_expert_E.detach(),
            "dropped": torch.zeros((), dtype=torch.long, device=x.device),
        }

    def _cuda_dtype_guard(self, x_TD: torch.Tensor):
        """grouped_gemm's CUDA op takes bf16 operands only (it has no autocast of its own).

        Under bf16 autocast the memory-optimized MLP casts x and the weights; a bf16 module needs nothing.
        fp32 training is refused; fp32 inference (evaluation) runs the dMoE under bf16 autocast."""
        dev = x_TD.device.type
        if dev not in BF16_ONLY_DEVICES:
            return contextlib.nullcontext()
        weight = self.router.layer.weight.dtype
        if torch.is_autocast_enabled(dev):
            if torch.get_autocast_dtype(dev) != torch.bfloat16:
                raise RuntimeError("model.backend=megablocks: grouped_gemm takes bfloat16 only; autocast "
                                   f"is {torch.get_autocast_dtype(dev)}: set train.precision: bf16")
            return contextlib.nullcontext()
        if x_TD.dtype == weight == torch.bfloat16:
            return contextlib.nullcontext()
        if self.training and torch.is_grad_enabled():
            raise RuntimeError(
                f"model.backend=megablocks on {dev}: MegaBlocks' grouped GEMM (grouped_gemm) takes bfloat16 "
                f"only, and this step computes in {x_TD.dtype} with {weight} weights: set train.precision: "
                "bf16 (fp32 weights, bf16 autocast), or use backend: torch for fp32 training"
            )
        return torch.autocast(dev, dtype=torch.bfloat16)
