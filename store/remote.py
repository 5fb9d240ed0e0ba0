"""An artifact store on object storage (an fsspec URL: `s3://bucket/prefix`, `gs://...`): no rename, no flock.

Layout as in a local store: `<url>/<stage>/<stage>-<hash>/manifest.json`. Publishing: the files go
under a fresh prefix of the artifact (`data-<id>/`), then the manifest, naming that prefix and every
file's size and xxh3, is written last: it is the commit marker, one PUT, so a killed writer leaves
nothing a reader accepts. Build locks are lease objects made with create-if-absent, renewed by a
heartbeat and lapsing when their holder dies (`Lease`). Stage bodies read a node-local mirror laid
out like a local store, filled as artifacts are needed, each file verified as it arrives and kept
while the artifact's content hash stays the same. Credentials come from the environment and fsspec's
own configuration (`AWS_*`, `FSSPEC_S3_*`, `~/.aws`), never from the run config or lineage.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import fsspec
import xxhash

from moeflow.store import local as artifacts
from moeflow.store.lease import Lease
from moeflow.store.local import LINEAGE, MANIFEST, ORIGIN, ArtifactError, Manifest, Store

log = logging.getLogger(__name__)


def mirror_root(url: str) -> Path:
    """This node's mirror of the store at `url`: `$MOEFLOW_STORE_CACHE/<url slug>`, by default under the
    data cache; `MOEFLOW_STORE_CACHE=none`: a folder of this process's own, removed when it exits (nothing
    kept between stages or runs). The URL alone names it (credentials are never part of a store URL)."""
    from moeflow.core.paths import cache_dir

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


class ObjectStore:
    """An artifact store at an fsspec URL, with the interface of `artifacts.Store`."""

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
        self._leases: dict[tuple[str, str], Lease] = {}

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    def _path(self, *parts: str) -> str:
        return "/".join([self.base, *parts])

    def folder(self, stage: str, key: str) -> Path:
        """The artifact's folder in this node's mirror."""
        return self.root / stage / f"{stage}-{key}"

    def get(self, stage: str, key: str) -> Manifest | None:
        try:
            data = json.loads(self.fs.cat_file(self._path(stage, f"{stage}-{key}", MANIFEST)))
        except FileNotFoundError:
            return None
        data["path"] = f"{self.url}/{stage}/{stage}-{key}/{PurePosixPath(data['path']).name}"
        return Manifest(**data)

    def newest(self, stage: str) -> dict | None:
        """The lineage record of the newest finished artifact of `stage` in the store, if any."""
        self.fs.invalidate_cache()
        recs = []
        for path in self.fs.glob(self._path(stage, f"{stage}-*", MANIFEST)):
            key = PurePosixPath(path).parent.name[len(stage) + 1:]
            manifest = self.get(stage, key)
            if manifest is not None:
                recs.append(manifest.lineage())
        return max(recs, key=lambda r: (r["finished_at"], r["artifact"]["hash"])) if recs else None

    @contextlib.contextmanager
    def lock(self, stage: str, key: str) -> Iterator[None]:
        """Hold the artifact's build lease: two runs (on any nodes) that need it build it once."""
        lease = Lease(self.fs, self._path(stage, ".leases", f"{stage}-{key}"))
        with lease:
            self._leases[stage, key] = lease
            try:
                yield
            finally:
                del self._leases[stage, key]

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        yield  # `moeflow gc` does not work on object stores yet (it refuses), so there is nothing to hold

    @contextlib.contextmanager
    def exclusive(self, wait: bool = True, say=print) -> Iterator[None]:
        raise ArtifactError(f"`moeflow gc` and `ls` work on local stores only, not yet on {self.url}")
        yield

    staging = Store.staging  # a local folder in the mirror: the stage body writes there, then `commit`

    def commit(self, stage: str, key: str, tmp: Path, stats: dict, lineage: dict) -> Manifest:
        """Upload `tmp` under a fresh prefix, then write the manifest (the commit marker); `tmp` becomes
        this node's mirror of the artifact."""
        name = f"{stage}-{key}"
        data = f"data-{uuid.uuid4().hex[:12]}"
        manifest = artifacts.seal(stage, key, tmp, stats, lineage, f"{self.url}/{stage}/{name}/{data}")
        local = [p for p in sorted(tmp.rglob("*")) if p.is_file() and p != tmp / MANIFEST]
        self.fs.put([str(p) for p in local], [self._path(stage, name, data, p.relative_to(tmp).as_posix())
                                              for p in local])
        lease = self._leases.get((stage, key))
        if lease is not None:
            lease.check()  # a holder whose lease lapsed (a long pause) must not publish over the new one
        self.fs.pipe_file(self._path(stage, name, MANIFEST), (tmp / MANIFEST).read_bytes())
        self._drop_stale(stage, name, keep=data)
        _replace(tmp, self.folder(stage, key))
        return manifest

    def _drop_stale(self, stage: str, name: str, keep: str) -> None:
        """Data prefixes no manifest names: an older version's, or a killed writer's."""
        for path in self.fs.ls(self._path(stage, name), detail=False, refresh=True):
            leaf = PurePosixPath(path).name
            if leaf.startswith("data-") and leaf != keep:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm(path, recursive=True)

    def runs(self) -> list[dict]:
        """The run records, oldest first (by the store's modification time)."""
        with contextlib.suppress(FileNotFoundError):
            listing = self.fs.ls(self._path("runs"), detail=True, refresh=True)
            listing.sort(key=lambda e: (str(e.get("LastModified", e.get("mtime", ""))), e["name"]))
            return [json.loads(self.fs.cat_file(e["name"])) for e in listing if e["name"].endswith(".json")]
        return []

    def record_run(self, summary: dict) -> None:
        text = json.dumps(summary, indent=2)
        self.fs.pipe_file(self._path("runs", f"{summary['flow_run_id']}.json"), text.encode())
        runs = self.root / "runs"  # and in the mirror, where `moeflow run` prints it from
        runs.mkdir(parents=True, exist_ok=True)
        (runs / f"{summary['flow_run_id']}.json").write_text(text)

    # --- reading into the mirror ---

    def pull(self, manifest: Manifest) -> Path:
        """The artifact's mirror folder, downloaded and verified unless it holds this content already."""
        folder = self.folder(manifest.stage, manifest.hash)
        if _current(folder, manifest):
            return folder
        folder.parent.mkdir(parents=True, exist_ok=True)
        with _flock(folder.with_name(f".{folder.name}.pull")):
            if _current(folder, manifest):
                return folder
            tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-pull-", dir=folder.parent))
            try:
                rels = [*manifest.files, LINEAGE]
                self.fs.get([self._remote(manifest, r) for r in rels], [str(tmp / r) for r in rels])
                for rel, meta in manifest.files.items():
                    if not artifacts.matches(tmp / rel, meta):
                        raise self._corrupt(manifest, rel)
                (tmp / MANIFEST).write_text(json.dumps(manifest.to_dict(), indent=2, sort_keys=True))
                _replace(tmp, folder)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return folder

    def pull_file(self, manifest: Manifest, rel: str) -> Path:
        """One file of the artifact into its mirror folder (verified when the manifest lists it; fetched again
        unless the folder holds the artifact's current content: a rerun may have replaced it)."""
        folder = self.folder(manifest.stage, manifest.hash)
        path = folder / rel
        if _current(folder, manifest):
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
        self.fs.get_file(self._remote(manifest, rel), str(part))
        if rel in manifest.files and not artifacts.matches(part, manifest.files[rel]):
            part.unlink()
            raise self._corrupt(manifest, rel)
        os.replace(part, path)
        return path

    def _remote(self, manifest: Manifest, rel: str) -> str:
        _, stage, data = _split(manifest.path)
        return self._path(stage, f"{stage}-{manifest.hash}", data, rel)

    def _corrupt(self, manifest: Manifest, rel: str) -> ArtifactError:
        return artifacts.corrupt(self._url(manifest, rel), self._url(manifest, MANIFEST), manifest.stage)

    def _url(self, manifest: Manifest, rel: str) -> str:
        base = manifest.path if rel != MANIFEST else manifest.path.rsplit("/", 1)[0]
        return f"{base}/{rel}"


def _current(folder: Path, manifest: Manifest) -> bool:
    """The mirror folder holds the artifact's content (its files were verified when they arrived)."""
    with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
        return json.loads((folder / MANIFEST).read_text())["content_hash"] == manifest.content_hash
    return False


def _replace(tmp: Path, folder: Path) -> None:
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, folder)


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    """A node-local lock: two processes on one node pull an artifact once."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def pull(manifest: Manifest) -> Path:
    return ObjectStore(_split(manifest.path)[0]).pull(manifest)


def pull_file(manifest: Manifest, rel: str) -> Path:
    return ObjectStore(_split(manifest.path)[0]).pull_file(manifest, rel)


def ensure(folder: Path, rel: str) -> Path:
    """`folder/rel` for a folder of a mirror (`<mirror>/<stage>/<stage>-<hash>`), from its store."""
    store = ObjectStore((folder.parent.parent / ORIGIN).read_text())
    stage = folder.parent.name
    manifest = store.get(stage, folder.name[len(stage) + 1:])
    if manifest is None:
        raise ArtifactError(f"{store.url}/{stage}/{folder.name} has no {MANIFEST}: not a complete artifact")
    return store.pull_file(manifest, rel)
