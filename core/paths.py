"""Where things live on this machine: the package's own folder, the data cache, and which file a path is now."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # the repository root, which is the `moeflow` package


def cache_dir() -> Path:
    """The data cache: `$MOEFLOW_CACHE`, else `~/.cache/moeflow`."""
    return Path(os.environ.get("MOEFLOW_CACHE") or Path.home() / ".cache" / "moeflow").expanduser().resolve()


def stat_identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """Device, inode, size, mtime and ctime (ns). A file replaced or rewritten changes one of them, its size kept
    and its mtime set back too (the system sets ctime on every change; no user can), unless the change falls
    within the same timestamp tick (a few ms) as the one before it."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns
