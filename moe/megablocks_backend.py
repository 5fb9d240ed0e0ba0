"""The MegaBlocks backend: `megablocks.layers.dmoe.dMoE` behind the reference layer's interface (CUDA only).

Imported only when `model.backend: megablocks` is selected. MegaBlocks keeps its load-balancing
losses in module globals; this wrapper turns them off (moe_loss_weight=0), clears the list after each
forward, and computes the losses itself from the same router weights, as the reference layer does.
Its parameters carry the same names and shapes as the reference layer (`router.layer.weight` [E, D];
`experts.mlp.w1`, `v1`, `w2` [E*F, D]), so one state dict loads into either backend with strict=True.
Untested here for want of a GPU: the parity test in tests/test_moe.py is marked `gpu` and skipped
without CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.configs import ModelConfig
from moeflow.moe.experts import SharedExpert
from moeflow.moe.losses import load_balancing_loss, router_z_loss

INSTALL = (
    "pip install --no-build-isolation --no-deps megablocks (on a CUDA machine, against the torch "
    "already installed; see README, 'GPU backend')"
)


class MegaBlocksMoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not torch.cuda.is_available():
            raise RuntimeError("model.backend=megablocks needs CUDA; use backend: torch on this machine")
        try:
            from megablocks.layers.arguments import Arguments
            from megablocks.layers.dmoe import dMoE
        except ImportError as e:
            raise RuntimeError(
                f"model.backend=megablocks: cannot import megablocks ({e}); {INSTALL}"
            ) from None
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        args = Arguments(
            hidden_size=cfg.d_model,
            ffn_hidden_size=cfg.expert_hidden,
            moe_num_experts=cfg.num_experts,
            moe_top_k=cfg.top_k,
            mlp_type="glu" if cfg.glu else "mlp",
            mlp_impl="grouped",
            activation_fn=F.silu if cfg.glu else F.gelu,
            bias=False,
            return_bias=False,
            fp16=False,
            bf16=False,
            moe_normalize_expert_weights=1.0 if cfg.normalize_expert_weights else None,
            moe_jitter_eps=cfg.router_jitter or None,
            moe_loss_weight=0.0,
            device=torch.cuda.current_device(),
        )
        self.dmoe = dMoE(args)
        # Expose the same parameter names as the reference layer (router.*, experts.*).
        self.router, self.experts = self.dmoe.router, self.dmoe.experts
        self.shared_expert = (
            SharedExpert(cfg.d_model, cfg.shared_expert_hidden, cfg.glu) if cfg.shared_expert_hidden else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        from megablocks.layers.moe import clear_load_balancing_loss

        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        out = self.dmoe(x_TD.unsqueeze(1)).reshape(shape)  # dMoE takes [sequence, batch, hidden]
        clear_load_balancing_loss()  # moe_loss_weight=0 saves nothing; clear anyway, the list is global
        # The auxiliary losses and metrics come from the same router weights, computed here as in the
        # reference layer (dMoE's jitter, when set, makes its choices differ slightly from these).
        logits_TE = self.router.layer(x_TD)
        probs_TE = logits_TE.float().softmax(-1)
        tokens_per_expert_E = torch.bincount(
            probs_TE.topk(self.top_k, dim=-1).indices.reshape(-1), minlength=self.num_experts
        )
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out, {
            "load_balancing_loss": load_balancing_loss(
                probs_TE=probs_TE, tokens_per_expert_E=tokens_per_expert_E
            ),
            "router_z_loss": router_z_loss(logits_TE=logits_TE),
            "tokens_per_expert": tokens_per_expert_E.detach(),
            "dropped": torch.zeros((), dtype=torch.long, device=x.device),
        }

    def state_dict(self, *args, **kwargs):
        return {k: v for k, v in super().state_dict(*args, **kwargs).items() if not k.startswith("dmoe.")}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return super().load_state_dict(
            {
                **state_dict,
                **{f"dmoe.{k}": v for k, v in state_dict.items() if k.startswith(("router.", "experts."))},
            },
            strict,
            assign,
        )
