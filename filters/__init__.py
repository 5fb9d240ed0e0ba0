"""The filter stage: language identification and heuristic quality filters (`heuristics.py`)."""

from moeflow.filters.heuristics import build, judge, merge, run, shard, stage

__all__ = ["build", "judge", "merge", "run", "shard", "stage"]
