"""Ingest: read every configured source into one document table, quarantining bad records with a reason.

Sources are resolved before any work (`resolve_sources`): a path that matches nothing fails the run
with a message naming the source. Document ids are `<source>/<file path>` for one-document-per-file
sources and `<source>/<file path>#L<line>` (or `<source>/<id field>`) for JSONL records.

Modules, bottom up: `errors`, `names`, `lines` (a file as lines, never held whole), `records` (what a
reader yields, the quarantine reasons), one reader per format (`text`, `jsonl`, `parquet`, `hf`),
`resolve` (a source's files), `plan` (units and shards), `reader` (every format behind one call),
`stage` (the stage body). Below are the names the pipeline, the CLI and the tests use.
"""

from moeflow.ingest.errors import SourceError
from moeflow.ingest.plan import Unit, assign, units
from moeflow.ingest.resolve import (
    ResolvedSource,
    preflight,
    resolve_source,
    resolve_sources,
    resolve_sources_list,
)
from moeflow.ingest.stage import merge, plan_part, read, shard

__all__ = [
    "ResolvedSource",
    "SourceError",
    "Unit",
    "assign",
    "merge",
    "plan_part",
    "preflight",
    "read",
    "resolve_source",
    "resolve_sources",
    "resolve_sources_list",
    "shard",
    "units",
]
