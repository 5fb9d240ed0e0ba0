"""This node's mirror of an object store: artifacts pulled into a local folder laid out like a local store.

A manifest read from the store names its files with their sizes and xxh3s; each file is verified as it
arrives, and a mirrored artifact is kept while its content hash stays the same. Reading needs only the
manifest's fields, so this module sits below the `Manifest` class that uses it (`Manifest.dir`).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import fsspec
import xxhash

from moeflow.core.paths import cache_dir
from moeflow.store.format import LINEAGE, MANIFEST, ORIGIN, ArtifactError, corrupt, matches


class Listed(Protocol):
    """What the mirror reads of a manifest (`local.Manifest` is one)."""

    stage: str
    hash: str
    content_hash: str
    path: str
    files: dict[str, dict]

    def to_dict(self) -> dict: ...


def mirror_root(url: str) -> Path:
    """This node's mirror of the store at `url`: `$MOEFLOW_STORE_CACHE/<url slug>`, by default under the
    data cache; `MOEFLOW_STORE_CACHE=none`: a folder of this process's own, removed when it exits (nothing
    kept between stages or runs). The URL alone names it (credentials are never part of a store URL)."""
    setting = os.environ.get("MOEFLOW_STORE_CACHE")
    base = _scratch() if setting == "none" else Path(setting or cache_dir() / "store-cache").expanduser()
    slug = re.sub(r"[^A-Za-z0-9]+", "_", url)[-60:].strip("_")
    return base.resolve() / f"{slug}-{xxhash.xxh3_64_hexdigest(url.encode())[:8]}"


@functools.cache
def _scratch() -> Path:
    path = Path(tempfile.mkdtemp(prefix="moeflow-mirror-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _split(path: str) -> tuple[str, str, str]:
    """A remote manifest's `path`, `<url>/<stage>/<stage>-<hash>/data-<id>` -> (url, stage, data prefix)."""
    url, stage, _, data = path.rsplit("/", 3)
    return url, stage, data


class Mirror:
    """The read side of the store at an fsspec URL: pulls artifacts into this node's mirror folder."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        try:
            self.fs, self.base = fsspec.url_to_fs(self.url)
        except ImportError as e:
            raise ArtifactError(f"the store {self.url} needs fsspec's backend for it: {e}") from None
        self.root = mirror_root(self.url)
        self.root.mkdir(parents=True, exist_ok=True)
        origin = self.root / ORIGIN
        if not origin.exists():
            origin.write_text(self.url)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def _path(self, *parts: str) -> str:
        return "/".join([self.base, *parts])

    def folder(self, stage: str, key: str) -> Path:
        """The artifact's folder in this node's mirror."""
        return self.root / stage / f"{stage}-{key}"

    def pull(self, manifest: Listed) -> Path:
        """The artifact's mirror folder, downloaded and verified unless it holds this content already."""
        folder = self.folder(manifest.stage, manifest.hash)
        if _current(folder, manifest):
            return folder
        folder.parent.mkdir(parents=True, exist_ok=True)
        with node_lock(folder.with_name(f".{folder.name}.pull")):
            if _current(folder, manifest):
                return folder
            tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-pull-", dir=folder.parent))
            try:
                rels = [*manifest.files, LINEAGE]
                try:
                    self.fs.get([self._remote(manifest, r) for r in rels], [str(tmp / r) for r in rels])
                except FileNotFoundError as e:
                    raise self._gone(manifest, e) from None
                for rel, meta in manifest.files.items():
                    if not matches(tmp / rel, meta):
                        raise self._corrupt(manifest, rel)
                (tmp / MANIFEST).write_text(json.dumps(manifest.to_dict(), indent=2, sort_keys=True))
                replace_folder(tmp, folder)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return folder

    def pull_file(self, manifest: Listed, rel: str) -> Path:
        """One file of the artifact into its mirror folder (verified when the manifest lists it; fetched again
        unless the folder holds the artifact's current content: a rerun may have replaced it)."""
        folder = self.folder(manifest.stage, manifest.hash)
        path = folder / rel
        if _current(folder, manifest):
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
        try:
            self.fs.get_file(self._remote(manifest, rel), str(part))
        except FileNotFoundError as e:
            part.unlink(missing_ok=True)
            raise self._gone(manifest, e) from None
        if rel in manifest.files and not matches(part, manifest.files[rel]):
            part.unlink()
            raise self._corrupt(manifest, rel)
        os.replace(part, path)
        return path

    def _remote(self, manifest: Listed, rel: str) -> str:
        _, stage, data = _split(manifest.path)
        return self._path(stage, f"{stage}-{manifest.hash}", data, rel)

    def _gone(self, manifest: Listed, error: FileNotFoundError) -> ArtifactError:
        """A file of the manifest's data prefix is missing: a rerun replaced the artifact while this reader
        held the old manifest (longer than the grace period superseded data is kept), or the store lost it."""
        try:
            now = json.loads(self.fs.cat_file(self._url(manifest, MANIFEST)))
        except FileNotFoundError:
            now = {}
        if now.get("path", "").rsplit("/", 1)[-1] == manifest.path.rsplit("/", 1)[-1]:
            return self._corrupt(manifest, str(error.args[-1] if error.args else error).rsplit("/", 1)[-1])
        return ArtifactError(f"{manifest.path}: this data was replaced (a rerun published a new version of "
                             f"{manifest.stage}-{manifest.hash}) and removed while this reader fetched it "
                             "from the old manifest: read the artifact again (a reader holding a manifest "
                             "longer than MOEFLOW_GRACE_SECONDS loses its data)")

    def _corrupt(self, manifest: Listed, rel: str) -> ArtifactError:
        return corrupt(self._url(manifest, rel), self._url(manifest, MANIFEST), manifest.stage)

    def _url(self, manifest: Listed, rel: str) -> str:
        base = manifest.path if rel != MANIFEST else manifest.path.rsplit("/", 1)[0]
        return f"{base}/{rel}"


def _current(folder: Path, manifest: Listed) -> bool:
    """The mirror folder holds the artifact's content (its files were verified when they arrived)."""
    with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
        return json.loads((folder / MANIFEST).read_text())["content_hash"] == manifest.content_hash
    return False


def replace_folder(tmp: Path, folder: Path) -> None:
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, folder)


@contextlib.contextmanager
def node_lock(path: Path) -> Iterator[None]:
    """A node-local lock: two processes on one node pull an artifact once."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def pull(manifest: Listed) -> Path:
    return Mirror(_split(manifest.path)[0]).pull(manifest)


def pull_file(manifest: Listed, rel: str) -> Path:
    return Mirror(_split(manifest.path)[0]).pull_file(manifest, rel)


