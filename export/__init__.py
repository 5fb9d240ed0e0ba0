"""The export: a trained model as a stock `transformers` folder that vLLM serves, checked by loading it back."""

from moeflow.configs import ConfigError
from moeflow.export.convert import unmappable


def preflight(cfg) -> None:
    """Refuse, before any work, a run whose model the export cannot express exactly (naming the option)."""
    if cfg.export is None:
        return
    why = unmappable(cfg.model)
    if why:
        raise ConfigError(f"config {cfg.name!r}: the export stage cannot write this model as a stock transformers "
                          f"architecture: {'; '.join(why)}; or set export: null to train without an export")
