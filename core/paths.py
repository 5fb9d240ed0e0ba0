"""Where things live on this machine: the package's own folder and the data cache."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # the repository root, which is the `moeflow` package


def cache_dir() -> Path:
    """The data cache: `$MOEFLOW_CACHE`, else `~/.cache/moeflow`."""
    return Path(os.environ.get("MOEFLOW_CACHE") or Path.home() / ".cache" / "moeflow").expanduser().resolve()
