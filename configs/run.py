"""The whole run's config (`RunConfig`), where it executes, and loading a preset or a YAML file (errors name the
field and the file)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from moeflow.configs.base import PRESETS_DIR, ConfigError, Frozen
from moeflow.configs.data import (
    BenchmarkConfig,
    DecontamConfig,
    DedupConfig,
    FilterConfig,
    MixConfig,
    Phase,
    PhaseConfig,
    SourceConfig,
    TokenizerConfig,
)
from moeflow.configs.quality import QualityConfig
from moeflow.configs.training import EvalConfig, ExportConfig, LadderConfig, ModelConfig, TrainConfig
from moeflow.core.paths import cache_dir
from moeflow.store.format import is_remote
from moeflow.store.mirror import mirror_root


class ExecutionConfig(Frozen):
    """Where shard tasks run; never part of an artifact's key (the output is the same wherever it runs)."""

    # processes: a local process pool (threads are not offered: the filters hold the GIL, and two threads
    # sharing spaCy's tokenizer corrupt it); ray: a Ray cluster through prefect-ray's RayTaskRunner;
    # dask: a Dask cluster through prefect-dask's DaskTaskRunner (worker processes, one thread each)
    runner: Literal["processes", "ray", "dask"] = "processes"
    # record shards of every sharded stage (contiguous row ranges, each a task and a cached artifact,
    # joined in order): the output is the same for any count; more shards, less memory per task
    shards: int = Field(default=1, ge=1)
    workers: int | None = Field(
        default=None, gt=0
    )  # processes, CPUs of a local Ray, local Dask workers; default: all cores
    ray_address: str | None = None
    dask_address: str | None = None  # an existing scheduler ("tcp://host:8786"); None: start a local cluster

    @model_validator(mode="after")
    def _check(self) -> ExecutionConfig:
        for name in ("ray", "dask"):
            if getattr(self, f"{name}_address") and self.runner != name:
                raise ValueError(
                    f"execution.{name}_address is set but execution.runner is {self.runner!r}; "
                    f"set runner: {name}, or remove the address"
                )
        return self


class RunConfig(Frozen):
    name: str
    seed: int = 1234
    store: str | None = None  # artifact store root; default `$MOEFLOW_STORE`, else `<data cache>/artifacts`
    sources: tuple[SourceConfig, ...] = Field(min_length=1)
    benchmarks: tuple[BenchmarkConfig, ...] = Field(min_length=1)
    filter: FilterConfig = FilterConfig()
    dedup: DedupConfig = DedupConfig()
    quality: QualityConfig | None = None  # set: a learned classifier scores the corpus and keeps the best
    decontaminate: DecontamConfig = DecontamConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    mix: MixConfig
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvalConfig = EvalConfig()
    # the trained model as a stock `transformers` folder, checked by loading it back; null: no export (a model
    # the export cannot express exactly, such as `model.glu: false`, needs it)
    export: ExportConfig | None = ExportConfig()
    ladder: LadderConfig | None = None  # set: a scaling ladder predicts the target run before it starts
    execution: ExecutionConfig = ExecutionConfig()

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be unique, got {names}")
        domains = {s.domain for s in self.sources}
        unknown = sorted(set(self.mix.weights) - domains)
        if unknown:
            raise ValueError(
                f"mix.weights names unknown domains {unknown}; the sources' domains are {sorted(domains)}"
            )
        for i, phase in enumerate(self.mix.phases):
            unknown = sorted(set(phase.weights or {}) - domains)
            if unknown:
                raise ValueError(
                    f"mix.phases.{i}.weights names unknown domains {unknown}; "
                    f"the sources' domains are {sorted(domains)}"
                )
        dist = self.train.distributed
        if dist.world_size > 1 and self.model.backend != "torch":
            raise ValueError(
                f"train.distributed runs the reference MoE layer: set model.backend: torch "
                f"(got {self.model.backend!r})"
            )
        if dist.world_size > 1 and dist.expert_parallel and self.model.num_experts % dist.world_size:
            raise ValueError(
                f"model.num_experts={self.model.num_experts} cannot be split over the {dist.world_size} "
                "ranks of train.distributed: choose a rank count that divides it, "
                "or set expert_parallel: false"
            )
        self.phases()  # budgets must add up to the run
        self._check_search()
        unknown = sorted(set(self.filter.overrides) - domains - set(names))
        if unknown:
            raise ValueError(
                f"filter.overrides names {unknown}, neither a domain nor a source; "
                f"domains: {sorted(domains)}, sources: {names}"
            )
        unknown = sorted(set(self.quality.overrides) - domains - set(names)) if self.quality else []
        if unknown:
            raise ValueError(f"quality.overrides names {unknown}, neither a domain nor a source; "
                             f"domains: {sorted(domains)}, sources: {names}")
        if self.mix.quality_buckets and self.quality is None:
            raise ValueError("mix.quality_buckets splits domains by the quality stage's scores: add a quality: "
                             "section (a classifier to score with) or remove mix.quality_buckets")
        return self

    def _check_search(self) -> None:
        """A mixture search's objective weighs domains the mix trains, and its proxies (shorter runs) can
        follow every phase: phases given in tokens have no share of a shorter run."""
        search = self.mix.search
        if search is None:
            return
        if not isinstance(search.objective, str):
            unknown = sorted(set(search.objective) - {d for d, w in self.mix.weights.items() if w > 0})
            if unknown:
                raise ValueError(f"mix.search.objective weighs {unknown}, not domains of mix.weights "
                                 f"{sorted(self.mix.weights)}")
        if any(p.tokens is not None for p in self.mix.phases):
            raise ValueError("mix.search needs every phase's budget as a `fraction` (a proxy runs a shorter "
                             "curriculum): replace `tokens` in mix.phases")

    def phases(self) -> list[Phase]:
        """The curriculum in whole optimizer steps; the phases' steps add up to train.steps."""
        t, specs = self.train, self.mix.phases or (PhaseConfig(name="main"),)
        out, start = [], 0
        for i, p in enumerate(specs):
            seq_len = p.seq_len or t.seq_len
            if p.fraction is not None:
                steps = round(p.fraction * t.steps)
            elif p.tokens is not None:
                steps = -(-p.tokens // (t.batch_size * seq_len))
            elif i == len(specs) - 1:
                steps = t.steps - start
            else:
                raise ValueError(
                    f"mix.phases.{i} ({p.name}): give `fraction` or `tokens` "
                    "(only the last phase may give neither)"
                )
            if i == len(specs) - 1 and p.fraction is not None and abs(start + steps - t.steps) <= 1:
                steps = t.steps - start  # rounding of fractions goes to the last phase
            if steps < 1:
                raise ValueError(f"mix.phases.{i} ({p.name}): its budget is less than one step")
            out.append(
                Phase(
                    name=p.name,
                    index=i,
                    steps=steps,
                    start_step=start,
                    seq_len=seq_len,
                    weights=p.weights or self.mix.weights,
                )
            )
            start += steps
        if start != t.steps:
            raise ValueError(
                f"mix.phases: the phases' budgets come to {start} steps, but train.steps is {t.steps}"
            )
        return out

    def store_url(self) -> str:
        """The artifact store: a local folder, or an fsspec URL (`s3://bucket/prefix`) for an object store."""

        root = self.store or os.environ.get("MOEFLOW_STORE")
        if root and is_remote(root):
            if "@" in root.split("://", 1)[1].split("/", 1)[0]:
                raise ValueError(f"the store URL {root.split('@')[-1]!r} carries credentials: give them in the "
                                 "environment (AWS_ACCESS_KEY_ID, ... or fsspec's configuration), not the URL")
            return root.rstrip("/")
        root = root and root.removeprefix("file://")
        return str(Path(os.path.expanduser(root)).resolve() if root else cache_dir() / "artifacts")

    def store_path(self) -> Path:
        """The store's local folder: the store itself, or this node's mirror of an object store."""

        url = self.store_url()
        if is_remote(url):

            return mirror_root(url)
        return Path(url)


def resolve(name_or_path: str | os.PathLike) -> Path:
    """A preset name (`tiny`) or a YAML path to an existing file."""
    text = str(name_or_path)
    path = Path(text)
    if not path.suffix and not path.exists():
        path = PRESETS_DIR / f"{text}.yaml"
    if not path.is_file():
        presets = ", ".join(sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")))
        raise ConfigError(f"config {text!r}: no such file or preset (presets: {presets})")
    return path.resolve()


def _yaml(path: Path):
    """A YAML file's data, parsed by libyaml (a tenth of the pure-Python parser's 15 ms: every part of a
    sharded stage a worker runs may load its config); a file it refuses is parsed again by the pure-Python
    parser, whose message quotes the line."""
    text = path.read_text()
    try:
        return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}
    except yaml.YAMLError:
        try:
            return yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None


def load(name_or_path: str | os.PathLike, **overrides) -> RunConfig:
    """Load and validate a config; `overrides` replace top-level sections (dicts merge one level)."""
    path = resolve(name_or_path)
    data = _yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    try:
        return RunConfig(**data)
    except ValidationError as e:
        problems = "; ".join(
            f"field '{'.'.join(str(p) for p in err['loc']) or '(top level)'}': {err['msg']}"
            for err in e.errors()
        )
        raise ConfigError(f"{path}: {problems}") from None
