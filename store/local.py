"""Content-addressed artifacts: `<store>/<stage>/<stage>-<hash>/` with `manifest.json` and `lineage.json`.

`hash` covers the stage name, its code version, the config fields that change its output and the
content hashes of its inputs, so an artifact's path is its version. `content_hash` covers the
bytes it holds (the xxh3 of every file), so downstream stages rerun only when it changes.
An artifact is written to a temporary folder and renamed into place; a folder without a complete
manifest is never read. A store at an fsspec URL (`s3://...`) is `store.remote`'s: `store.url.store_for` picks.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from moeflow.core import faults
from moeflow.store import mirror
from moeflow.store.format import (
    LINEAGE,
    MANIFEST,
    RUN_LOCK,
    ArtifactError,
    canonical_json,
    corrupt,
    file_xxh3,
    is_remote,
    matches,
)


@dataclass(frozen=True)
class Manifest:
    """What an arrow of the DAG carries: where an artifact is and what it holds, never the data."""

    stage: str
    hash: str
    content_hash: str
    path: str  # absolute path of the artifact folder
    files: dict[str, dict] = field(default_factory=dict)  # relpath -> {"bytes", "xxh3"}
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.stage}-{self.hash}"

    @property
    def remote(self) -> bool:
        return is_remote(self.path)

    @property
    def dir(self) -> Path:
        """The artifact's folder here: an object store's artifact is first pulled into this node's mirror
        (verified as it comes)."""
        if not self.remote:
            return Path(self.path)
        return mirror.pull(self)

    def lineage(self) -> dict:
        """The artifact's lineage record (only that file is fetched from an object store)."""
        if not self.remote:
            return json.loads((self.dir / LINEAGE).read_text())
        return json.loads(mirror.pull_file(self, LINEAGE).read_text())

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        path = Path(folder) / MANIFEST
        if not path.exists():
            raise ArtifactError(f"{folder} has no {MANIFEST}: it is not a complete artifact")
        data = json.loads(path.read_text())
        data["path"] = str(Path(folder).resolve())  # the store may have moved
        return cls(**data)

    def verify(self) -> None:
        """Check every file against its xxh3 in the manifest (once per process while the file is unchanged:
        the parts of a sharded stage that a worker runs read the same input)."""
        folder = self.dir
        for rel, meta in self.files.items():
            if not matches(folder / rel, meta):
                raise self._replaced(folder) or corrupt(folder / rel, folder / MANIFEST, self.stage)

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Hold a local artifact while a stage reads it: a rerun that replaces it meanwhile (the reader may have
        read some files old and some new, or found one missing mid-swap) raises the error saying so, whatever
        the reader raised (short of a Ctrl-C) or returned. An object store's artifact is read from this node's
        verified mirror, not held here (`store.mirror`)."""
        if self.remote:
            yield
            return
        folder = Path(self.path)
        held = _identity(folder)

        def replaced() -> ArtifactError | None:
            return self._replaced(folder, swapped=held is None or _identity(folder) != held)

        try:
            yield
        except Exception as e:  # not a Ctrl-C: that stays what it is
            error = replaced()
            if error is None:
                raise
            raise error from e
        if (error := replaced()) is not None:
            raise error

    def _replaced(self, folder: Path, swapped: bool = False) -> ArtifactError | None:
        """The error for a local artifact that a rerun replaced since this manifest was read, if it was
        (`swapped`: its folder was, whatever it holds now)."""
        now = None
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
            now = json.loads((folder / MANIFEST).read_text())["content_hash"]
        if not swapped and now in (None, self.content_hash):
            return None
        return ArtifactError(f"{folder} was replaced (a rerun published a new version of {self.name}, "
                             f"content {self.content_hash} -> {now or 'not in place yet'}) while this reader "
                             "held the old manifest: read the artifact again (run again: it reuses the new one)")


class Store:
    """An artifact store rooted at a local folder."""

    def __init__(self, root: Path | str):
        self.root = Path(root).expanduser().resolve()

    def folder(self, stage: str, key: str) -> Path:
        return self.root / stage / f"{stage}-{key}"

    def get(self, stage: str, key: str) -> Manifest | None:
        folder = self.folder(stage, key)
        if not (folder / MANIFEST).exists():
            return None
        return Manifest.read(folder)

    def newest(self, stage: str) -> dict | None:
        """The lineage record of the newest finished artifact of `stage` in the store, if any."""
        recs = [json.loads(p.read_text()) for p in (self.root / stage).glob(f"{stage}-*/{LINEAGE}")]
        return max(recs, key=lambda r: (r["finished_at"], r["artifact"]["hash"])) if recs else None

    @contextlib.contextmanager
    def lock(self, stage: str, key: str) -> Iterator[None]:
        """Hold the artifact's build lock (an advisory `flock`, released when the holder dies): two runs
        that need the same artifact build it once; the second waits, then finds it in the store."""
        path = self.root / stage / f".{stage}-{key}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """Hold the store's run lock shared while a run uses the store (any number of runs at once);
        `moeflow gc` takes it exclusively, so it never removes what a running run may still read."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / RUN_LOCK, "a") as f:
            fcntl.flock(f, fcntl.LOCK_SH)
            yield

    @contextlib.contextmanager
    def exclusive(self, wait: bool = True, say=print) -> Iterator[None]:
        """Hold the store's run lock exclusively (`moeflow gc`): wait for the runs using the store to end,
        or, with `wait=False`, raise ArtifactError saying they are there."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / RUN_LOCK, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not wait:
                    raise ArtifactError(f"the store {self.root} is in use by a running run; retry when it "
                                        "has ended, or wait for it (without --no-wait)") from None
                say(f"waiting for the runs using {self.root} to end ...")
                fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def staging(self, stage: str) -> Path:
        parent = self.root / stage
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{stage}-tmp-", dir=parent))

    def commit(self, stage: str, key: str, tmp: Path, stats: dict, lineage: dict) -> Manifest:
        """Checksum, write manifest and lineage, fsync, and rename `tmp` into place (replacing an old one)."""
        final = self.folder(stage, key)
        manifest = seal(stage, key, tmp, stats, lineage, str(final))
        faults.at("publish")  # `make chaos`: sealed in staging, not yet renamed into place
        old = None
        if final.exists():  # a rerun replaces the old artifact; move it aside first so the swap is atomic
            old = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.old")
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        if old is not None:
            _discard(old)
        return manifest

    def runs(self) -> list[dict]:
        """The run records (`runs/<flow run id>.json`), oldest first."""
        paths = sorted((self.root / "runs").glob("*.json"), key=lambda p: (p.stat().st_mtime, p.name))
        return [json.loads(p.read_text()) for p in paths]

    def run(self, flow_run_id: str) -> dict:
        """One run's record, read from the store (wherever the run ran)."""
        try:
            return json.loads((self.root / "runs" / f"{flow_run_id}.json").read_text())
        except FileNotFoundError:
            raise ArtifactError(f"the store {self.root} has no record of flow run {flow_run_id}: did the run "
                                "use another store (`store:` in its config, MOEFLOW_STORE)?") from None

    def record_run(self, summary: dict) -> None:
        runs = self.root / "runs"
        runs.mkdir(parents=True, exist_ok=True)
        (runs / f"{summary['flow_run_id']}.json").write_text(json.dumps(summary, indent=2))


def seal(stage: str, key: str, tmp: Path, stats: dict, lineage: dict, path: str) -> Manifest:
    """Checksum the files in `tmp` and write its manifest and lineage record (`path`: where it will live)."""
    files = {}
    for p in sorted(tmp.rglob("*")):
        if p.is_file():
            files[p.relative_to(tmp).as_posix()] = {"bytes": p.stat().st_size, "xxh3": file_xxh3(p)}
    content = xxhash.xxh3_64_hexdigest(canonical_json(files).encode())
    manifest = Manifest(stage=stage, hash=key, content_hash=content, path=path, files=files, stats=stats)
    lineage = {**lineage, "artifact": {"stage": stage, "hash": key, "content_hash": content}}
    _write_synced(tmp / LINEAGE, json.dumps(lineage, indent=2, sort_keys=True, default=str))
    _write_synced(tmp / MANIFEST, json.dumps(manifest.to_dict(), indent=2, sort_keys=True, default=str))
    return manifest


def _discard(folder: Path) -> None:
    """Delete a replaced artifact's folder on a thread of its own: a forced rerun's commit returns without
    waiting for its files' unlinking (0.1-0.2 s for the 17 artifacts of a 16-shard ingest on a busy disk).
    The folder is out of every reader's way already (a unique `.old` name); the thread is not a daemon, so
    the process waits for it when it exits, and one it never finished (the process killed) is stale to
    `moeflow gc` (`gc.stale`: `.*.old`)."""
    threading.Thread(target=shutil.rmtree, args=(folder,), kwargs={"ignore_errors": True},
                     name=f"discard {folder.name}").start()


def _identity(folder: Path) -> tuple[int, int] | None:
    """Which folder is at `folder` (a rerun's commit swaps another in); None: none, mid-swap."""
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
