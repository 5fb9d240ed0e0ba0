"""The MoE layer a Transformer block gets: the reference layer (moe/layer.py) or MegaBlocks' dMoE behind
the same interface (moe/megablocks_backend.py, CUDA).

The choice lives above both layers because the MegaBlocks wrapper builds a reference layer to draw its
initial weights from: the reference layer must not import the wrapper back.
"""

from __future__ import annotations

from torch import nn

from moeflow.configs import ModelConfig
from moeflow.moe import megablocks_backend
from moeflow.moe.layer import MoE


def build_moe(cfg: ModelConfig) -> nn.Module:
    if cfg.backend == "megablocks":
        # through the module, at call time: tests/test_megablocks.py wraps the class to fake CUDA
        return megablocks_backend.MegaBlocksMoE(cfg)
    return MoE(cfg)
