"""The stage this package declares: `ingest`, the sources cut into pieces read as record shards, then joined."""

from __future__ import annotations

from moeflow import ingest
from moeflow.core.stage import Phase, Stage, record_shards
from moeflow.sources.stage import identities

INGEST = Stage(
    "ingest",
    lambda c: c.sources,
    None,
    ("pyarrow", "zstandard", "datasets"),  # datasets: hf_dataset and hf_files sources
    fetched=lambda s: identities([x.package for x in s if x.package], s),
    phases=(Phase("shard", ingest.shard, record_shards),),
    merge=ingest.merge,
)
