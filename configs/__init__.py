"""Typed, frozen run configuration, loaded from the YAML presets in this folder and validated on load.

A preset name (`tiny`, `smoke`) or a path to a YAML file. Errors name the field and the file. Configs are
frozen because stage hashes are computed from them: `base.py` (the base classes), `data.py` (the data stages'
slices), `training.py` (model, training, ladder, evaluation), `run.py` (the whole run and loading it).
"""

from moeflow.configs.base import ConfigError
from moeflow.configs.data import (
    DATATROVE_FILTERS,
    BenchmarkConfig,
    DecontamConfig,
    DedupConfig,
    FilterConfig,
    Format,
    HeldoutConfig,
    MixConfig,
    MixSearchConfig,
    Phase,
    SourceConfig,
    TokenizerConfig,
    TokenizerKind,
)
from moeflow.configs.quality import (
    ClassifierTrain,
    Coherence,
    Grammar,
    KeepRule,
    PositiveSource,
    QualityConfig,
    SyntheticNegatives,
)
from moeflow.configs.run import RunConfig, load, resolve
from moeflow.configs.training import (
    AlarmConfig,
    EvalConfig,
    ExportConfig,
    LadderConfig,
    ModelConfig,
    TrainConfig,
    TrainStageConfig,
)

__all__ = [
    "AlarmConfig",
    "BenchmarkConfig",
    "ClassifierTrain",
    "Coherence",
    "Grammar",
    "SyntheticNegatives",
    "ConfigError",
    "DATATROVE_FILTERS",
    "DecontamConfig",
    "DedupConfig",
    "EvalConfig",
    "ExportConfig",
    "FilterConfig",
    "HeldoutConfig",
    "KeepRule",
    "Format",
    "LadderConfig",
    "MixConfig",
    "MixSearchConfig",
    "ModelConfig",
    "Phase",
    "PositiveSource",
    "QualityConfig",
    "RunConfig",
    "SourceConfig",
    "TokenizerConfig",
    "TokenizerKind",
    "TrainConfig",
    "TrainStageConfig",
    "load",
    "resolve",
]
