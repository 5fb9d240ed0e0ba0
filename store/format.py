"""The store's on-disk format: file names, the error every store raises, checksums and artifact keys."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import xxhash

from moeflow.core.paths import stat_identity

MANIFEST = "manifest.json"
LINEAGE = "lineage.json"
RUN_LOCK = ".runs.lock"  # held shared by every run, exclusively by `moeflow gc`
ORIGIN = ".moeflow-origin"  # in an object store's mirror (`store.remote`): the store's URL


class ArtifactError(RuntimeError):
    """A stored artifact is missing, incomplete or corrupt; the message says how to rebuild it."""


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def stage_hash(stage: str, version: int, config: Any, inputs: dict[str, str]) -> str:
    """The key of a stage's output: stage, code version, config that matters, input content hashes."""
    payload = canonical_json({"stage": stage, "version": version, "config": config, "inputs": inputs})
    return xxhash.xxh3_64_hexdigest(payload.encode())


def file_xxh3(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, xxhash.xxh3_64).hexdigest()


_SEEN: dict[tuple, str] = {}  # (path, `stat_identity`) -> the xxh3 this process read


def _checksum(path: Path) -> str:
    key = (str(path), *stat_identity(path.stat()))
    if key not in _SEEN:
        _SEEN[key] = file_xxh3(path)
    return _SEEN[key]


def matches(path: Path, meta: dict) -> bool:
    return path.exists() and path.stat().st_size == meta["bytes"] and _checksum(path) == meta["xxh3"]


def corrupt(what: Any, manifest: Any, stage: str) -> ArtifactError:
    return ArtifactError(f"{what} is missing or does not match its checksum in {manifest}; "
                         f"rebuild it with `moeflow run CONFIG --rerun {stage.split('.')[0]}`")


def is_remote(url: str | os.PathLike) -> bool:
    """An fsspec URL other than a local file one: `s3://bucket/prefix`, `gs://...`."""
    return "://" in str(url) and not str(url).startswith("file://")


