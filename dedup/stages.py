"""The stages this package declares: `dedup` (a distributed reduce in four phases), `benchmarks` (the index of
benchmark items), `decontaminate` and `overlap` (record-sharded)."""

from __future__ import annotations

from collections.abc import Callable

from moeflow.configs import RunConfig
from moeflow.core.stage import Phase, Stage, record_shards
from moeflow.dedup import contamination, corpus
from moeflow.sources.stage import file_identity, identities


def _dedup_parts(phase: str) -> Callable[[RunConfig, dict], int]:
    if phase == "pairs":
        return lambda c, inputs: corpus.partitions(c.dedup, inputs["docs"].dir)
    return (lambda c, inputs: 1) if phase == "clusters" else record_shards


def _index_config(c: RunConfig) -> dict:
    d = c.decontaminate
    return {
        "benchmarks": c.benchmarks,
        "ngram": d.ngram,
        "max_items_per_ngram": d.max_items_per_ngram,
        "min_alpha_words": d.min_alpha_words,
        "edited_ngram": d.edited_ngram,
    }


def _benchmark_files(s: dict) -> dict:
    """The packages the benchmarks come from, and your own eval sets' files by their bytes."""
    benches = s["benchmarks"]
    own = {f"file:benchmark:{b.name}": file_identity(b.path) for b in benches if not b.package}
    return identities([b.package for b in benches if b.package]) | own


DEDUP = Stage(
    "dedup",
    lambda c: c.dedup,
    None,
    ("xxhash", "numpy", "pyarrow"),
    reads="docs",
    phases=tuple(Phase(name, body, _dedup_parts(name)) for name, body in corpus.PHASES),
    merge=corpus.merge,
    section="dedup",
)
BENCHMARKS = Stage(
    "benchmarks",
    _index_config,
    contamination.index_stage,
    ("numpy", "pyarrow"),
    fetched=_benchmark_files,
)
DECONTAMINATE = Stage(
    "decontaminate",
    lambda c: c.decontaminate,
    contamination.stage,
    ("numpy",),
    reads="docs",
    phases=(Phase("shard", contamination.shard, record_shards),),
    merge=contamination.merge,
    section="decontaminate",
)
OVERLAP = Stage(
    "overlap",
    lambda c: {"ngram": c.decontaminate.ngram},
    contamination.overlap_stage,
    ("numpy", "tokenizers"),
    reads="shards",
    phases=(Phase("shard", contamination.overlap_part, record_shards),),
    merge=contamination.overlap_merge,
    section="decontaminate",
)
