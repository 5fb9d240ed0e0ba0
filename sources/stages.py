"""The stage this package declares: `sources`, the registry packages a run reads, fetched and verified."""

from __future__ import annotations

from moeflow.core.stage import Stage
from moeflow.sources import stage as sources

SOURCES = Stage("sources", sources.config, sources.run, fetched=sources.fetched)
