"""The stages this package declares: `sources` (the registry packages and local files a run reads, fetched and
identified) and `ingest` (the sources listed once and cut into pieces, read as record shards, then joined)."""

from __future__ import annotations

from moeflow import ingest
from moeflow.core.stage import Phase, Stage, record_shards
from moeflow.ingest import sources_stage

SOURCES = Stage("sources", sources_stage.config, sources_stage.run, fetched=sources_stage.fetched)
INGEST = Stage(
    "ingest",
    lambda c: c.sources,
    None,
    ("pyarrow", "zstandard", "orjson", "datasets"),  # datasets: hf_dataset and hf_files sources
    fetched=lambda s: sources_stage.identities([x.package for x in s if x.package], s),
    phases=(Phase("plan", ingest.plan_part, lambda c, inputs: 1, plans=True),
            Phase("shard", ingest.shard, record_shards)),
    merge=ingest.merge,
    section="sources",
)
