"""Opening a store by URL: a local folder (a plain path or `file://`) or an object store (`s3://...`)."""

from __future__ import annotations

import os
from pathlib import Path

from moeflow.store.format import ORIGIN, is_remote
from moeflow.store.local import Store
from moeflow.store.remote import ObjectStore, ensure_file


def store_for(url: str | os.PathLike):
    """The store at `url`: a local folder (a plain path or `file://`), else an object store."""
    if not is_remote(url):
        return Store(str(url).removeprefix("file://"))
    return ObjectStore(str(url))


def ensure(folder: Path, rel: str) -> Path:
    """`folder/rel`, fetched first when `folder` is an object store's artifact in this node's mirror (unless
    the mirror holds the artifact's current content)."""
    if not (Path(folder).parent.parent / ORIGIN).exists():
        return Path(folder) / rel
    return ensure_file(Path(folder), rel)


