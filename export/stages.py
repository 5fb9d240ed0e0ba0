"""The stage this package declares: `export` (its body imports torch and transformers, so it is named, not
imported)."""

from __future__ import annotations

from moeflow.configs import ExportConfig, RunConfig
from moeflow.core.stage import Lazy, Stage


def _export_config(c: RunConfig) -> ExportConfig:
    """The export compares the rows evaluation scores, where evaluation computes, unless it says otherwise."""
    e = c.export or ExportConfig()
    return e.model_copy(update={
        "max_sequences_per_domain": e.max_sequences_per_domain or c.evaluate.max_sequences_per_domain,
        "device": e.device or c.evaluate.device or c.train.device})


EXPORT = Stage("export", _export_config, Lazy("moeflow.export.stage:stage"),
               ("torch", "transformers", "safetensors", "tokenizers", "huggingface_hub", "matplotlib", "markdown"),
               section="export")
