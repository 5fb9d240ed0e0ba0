"""Every stage by name, in the order of the DAG: `--rerun`, `--until` and `moeflow why` name stages so.

Each stage is declared in its own package's `stages.py`; the flow imports the values themselves.
"""

from __future__ import annotations

from moeflow.card.stages import CARD
from moeflow.core.stage import Stage
from moeflow.dedup.stages import BENCHMARKS, DECONTAMINATE, DEDUP, OVERLAP
from moeflow.export.stages import EXPORT
from moeflow.filters.stages import FILTER
from moeflow.ingest.stages import INGEST, SOURCES
from moeflow.moe.stages import EVALUATE, LADDER, MIX_SEARCH, PROXY, RUNG, TRAIN
from moeflow.quality.stages import QUALITY, QUALITY_MODEL
from moeflow.tokenize.stages import MIX, PROXY_MIX, RUNG_MIX, TOKENIZE, TOKENIZER

STAGES: dict[str, Stage] = {
    s.name: s
    for s in (SOURCES, INGEST, FILTER, DEDUP, QUALITY_MODEL, QUALITY, BENCHMARKS, DECONTAMINATE, OVERLAP,
              TOKENIZER, TOKENIZE, PROXY_MIX, PROXY, MIX_SEARCH, MIX, RUNG_MIX, RUNG, LADDER, TRAIN, EVALUATE, EXPORT,
              CARD)
}
