"""An artifact store on object storage (an fsspec URL: `s3://bucket/prefix`, `gs://...`): no rename, no flock.

Layout as in a local store: `<url>/<stage>/<stage>-<hash>/manifest.json`. Publishing: the files go
under a fresh prefix of the artifact (`data-<id>/`), then the manifest, naming that prefix and every
file's size and xxh3, is written last: it is the commit marker, one conditional PUT (only over the
manifest the writer saw when it took the build lease: `lease.put_if`), so a killed writer leaves nothing
a reader accepts and a writer whose lease lapsed cannot commit over another's. A prefix no manifest
names any more (a rerun's predecessor, a killed writer's) is marked (`.superseded/data-<id>`) and
removed by a later publish of that artifact or by `moeflow gc` once `MOEFLOW_GRACE_SECONDS` (default a
day) have passed, so a reader of the old manifest finishes; one that still loses the race gets an
`ArtifactError` saying so. Build locks, and the run lock `moeflow gc` takes, are lease objects made with
create-if-absent, renewed by a heartbeat and lapsing when their holder dies (`Lease`). Stage bodies read
a node-local mirror laid out like a local store, filled as artifacts are needed, each file verified as it
arrives and kept while the artifact's content hash stays the same. Credentials come from the environment
and fsspec's own configuration (`AWS_*`, `FSSPEC_S3_*`, `~/.aws`), never from the run config or lineage.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import fsspec

from moeflow.core import faults
from moeflow.store.format import MANIFEST, ORIGIN, ArtifactError
from moeflow.store.lease import Lease, LeaseLost, Superseded, put_if, version
from moeflow.store.local import Manifest, Store, seal
from moeflow.store.mirror import Mirror, replace_folder

log = logging.getLogger(__name__)
SUPERSEDED = ".superseded"  # <artifact>/.superseded/data-<id>: since when no manifest names that prefix
RUNS_LOCK = ".runs.lock"  # <url>/.runs.lock/<id>: the lease of a run using the store (`in_use`)
GC_LOCK = ".gc.lock"  # <url>/.gc.lock: `moeflow gc`'s lease (`exclusive`)


def grace_seconds() -> float:
    """How long superseded data stays readable (`MOEFLOW_GRACE_SECONDS`, default a day)."""
    return float(os.environ.get("MOEFLOW_GRACE_SECONDS", 86400))


class ObjectStore(Mirror):
    """An artifact store at an fsspec URL, with the interface of `local.Store`; its reading is `Mirror`'s."""

    def __init__(self, url: str):
        super().__init__(url)
        self._leases: dict[tuple[str, str], tuple[Lease, str | None]] = {}  # held: lease, manifest version

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
            self._leases[stage, key] = lease, version(self.fs, self._path(stage, f"{stage}-{key}", MANIFEST))
            try:
                yield
            finally:
                del self._leases[stage, key]

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """Hold a run lease of this run's own (`.runs.lock/<id>`) while it uses the store (any number of runs
        at once), taken only while `moeflow gc` holds none (`exclusive`): a run waits for that gc to end. A run
        whose lease lapses (renewals failing for the lease time) stops with `LeaseLost`, as a build does."""
        gc_lease = Lease(self.fs, self._path(GC_LOCK))
        while True:
            while gc_lease.holder() is not None:
                time.sleep(1)
            with Lease(self.fs, self._path(RUNS_LOCK, uuid.uuid4().hex)):
                if gc_lease.holder() is None:  # gc takes its lease, then looks for runs': one of them waits
                    yield
                    return

    @contextlib.contextmanager
    def exclusive(self, wait: bool = True, say=print) -> Iterator[None]:
        """Hold the store's gc lease (`.gc.lock`) with no run lease live (`moeflow gc`): wait for the runs
        using the store to end, or, with `wait=False`, raise ArtifactError saying they are there. A run that
        ended without releasing its lease holds it until it lapses; released and lapsed ones are removed."""
        said = False
        with Lease(self.fs, self._path(GC_LOCK)):
            while running := self._runs_using():
                if not wait:
                    raise ArtifactError(f"the store {self.url} is in use by a running run ({running[0]['host']} "
                                        f"pid {running[0]['pid']}); retry when it has ended, or wait for it "
                                        "(without --no-wait)")
                if not said:
                    say(f"waiting for the runs using {self.url} to end ...")
                    said = True
                time.sleep(1)
            yield

    def _runs_using(self) -> list[dict]:
        """The live holders of run leases; the prefixes of the others are removed."""
        live = []
        with contextlib.suppress(FileNotFoundError):
            for prefix in self.fs.ls(self._path(RUNS_LOCK), detail=False, refresh=True):
                if (holder := Lease(self.fs, prefix).holder()) is not None:
                    live.append(holder)
                else:
                    self.fs.rm(prefix, recursive=True)
        return live

    staging = Store.staging  # a local folder in the mirror: the stage body writes there, then `commit`

    def commit(self, stage: str, key: str, tmp: Path, stats: dict, lineage: dict) -> Manifest:
        """Upload `tmp` under a fresh prefix, then write the manifest (the commit marker) if no other writer
        published since this one took the lease (or, without one, since it began); `tmp` becomes this
        node's mirror of the artifact."""
        name = f"{stage}-{key}"
        target = self._path(stage, name, MANIFEST)
        lease, base = self._leases.get((stage, key)) or (None, version(self.fs, target))
        data = f"data-{uuid.uuid4().hex[:12]}"
        manifest = seal(stage, key, tmp, stats, lineage, f"{self.url}/{stage}/{name}/{data}")
        local = [p for p in sorted(tmp.rglob("*")) if p.is_file() and p != tmp / MANIFEST]
        self.fs.put([str(p) for p in local], [self._path(stage, name, data, p.relative_to(tmp).as_posix())
                                              for p in local])
        faults.at("publish")  # `make chaos`: the data uploaded, no manifest names it yet
        try:
            if lease is not None:
                lease.settle()  # from here `check` and the conditional write decide, not an interrupt
                lease.check()  # a holder whose lease lapsed (a long pause) must not publish over the new one
            put_if(self.fs, target, (tmp / MANIFEST).read_bytes(), base)
        except (LeaseLost, Superseded) as e:
            with contextlib.suppress(Exception):  # no manifest names this build's prefix
                self.fs.rm(self._path(stage, name, data), recursive=True)
            if isinstance(e, Superseded):
                raise ArtifactError(f"{self.url}/{stage}/{name} was published by another writer while this "
                                    "one built it (this writer's build lease had lapsed); nothing of this build "
                                    "was published: run again (it reuses that artifact)") from None
            raise
        self._sweep(stage, name, keep=data)
        replace_folder(tmp, self.folder(stage, key))
        return manifest

    def _sweep(self, stage: str, name: str, keep: str) -> None:
        """Remove the artifact's data prefixes no manifest names that `superseded` finds past the grace
        period (`keep`: the one its manifest names now, unmarked whatever a racing writer marked)."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._path(stage, name, SUPERSEDED, keep))
        for path, since in self.superseded(stage, name, keep).items():
            if time.time() - since >= grace_seconds():
                self.drop(path)

    def superseded(self, stage: str, name: str, keep: str | None, mark: bool = True) -> dict[str, float]:
        """The artifact's data prefixes but `keep` (an older version's, a killed writer's), each with since
        when no manifest names it: its mark's time, or now for one seen first now (marked, with `mark`)."""
        now, found = time.time(), {}
        for path in self.fs.ls(self._path(stage, name), detail=False, refresh=True):
            leaf = PurePosixPath(path).name
            if not leaf.startswith("data-") or leaf == keep:
                continue
            try:
                found[path] = float(self.fs.cat_file(self._path(stage, name, SUPERSEDED, leaf)))
            except FileNotFoundError:
                found[path] = now
                if mark:
                    self.fs.pipe_file(self._path(stage, name, SUPERSEDED, leaf), str(now).encode())
        return found

    def drop(self, data: str) -> None:
        """Remove a superseded data prefix and its mark."""
        prefix, leaf = data.rsplit("/", 1)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(data, recursive=True)
            self.fs.rm(f"{prefix}/{SUPERSEDED}/{leaf}")

    def runs(self) -> list[dict]:
        """The run records, oldest first (by the store's modification time)."""
        with contextlib.suppress(FileNotFoundError):
            listing = self.fs.ls(self._path("runs"), detail=True, refresh=True)
            listing.sort(key=lambda e: (str(e.get("LastModified", e.get("mtime", ""))), e["name"]))
            return [json.loads(self.fs.cat_file(e["name"])) for e in listing if e["name"].endswith(".json")]
        return []

    def run(self, flow_run_id: str) -> dict:
        """One run's record, read from the object store (the mirror of the node that ran it may be gone:
        another node's, or a scratch one with `MOEFLOW_STORE_CACHE=none`)."""
        try:
            return json.loads(self.fs.cat_file(self._path("runs", f"{flow_run_id}.json")))
        except FileNotFoundError:
            raise ArtifactError(f"the store {self.url} has no record of flow run {flow_run_id}: did the run "
                                "use another store (`store:` in its config, MOEFLOW_STORE)?") from None

    def record_run(self, summary: dict) -> None:
        self.fs.pipe_file(self._path("runs", f"{summary['flow_run_id']}.json"),
                          json.dumps(summary, indent=2).encode())

def ensure_file(folder: Path, rel: str) -> Path:
    """`folder/rel` for a folder of a mirror (`<mirror>/<stage>/<stage>-<hash>`), from its store."""
    store = ObjectStore((folder.parent.parent / ORIGIN).read_text())
    stage = folder.parent.name
    manifest = store.get(stage, folder.name[len(stage) + 1:])
    if manifest is None:
        raise ArtifactError(f"{store.url}/{stage}/{folder.name} has no {MANIFEST}: not a complete artifact")
    return store.pull_file(manifest, rel)


class SharedFolder:
    """A folder of this node's mirror (`<mirror>/<stage>/<name>`) kept in its object store as well, so that the
    other nodes of a multi-node launch read it through the store: the launch spec, training checkpoints."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        store, stage, name = self.url.rsplit("/", 2)
        self.fs, self.base = fsspec.url_to_fs(self.url)
        self.local = Mirror(store).root / stage / name

    @classmethod
    def of(cls, folder: Path) -> SharedFolder | None:
        """The shared folder for a folder of an object store's mirror; None for any other (a local store's
        folder is shared, if at all, by the filesystem)."""
        origin = Path(folder).parent.parent / ORIGIN
        if not origin.exists():
            return None
        return cls(f"{origin.read_text()}/{Path(folder).parent.name}/{Path(folder).name}")

    def names(self, rel: str) -> list[str]:
        """The entries directly under `rel` in the store, sorted."""
        with contextlib.suppress(FileNotFoundError):
            return sorted(PurePosixPath(p).name for p in self.fs.ls(f"{self.base}/{rel}", detail=False,
                                                                    refresh=True))
        return []

    def put(self, rel: str, last: str | None = None) -> None:
        """Upload `local/rel` (a file or a folder) to the store; in a folder, the file named `last` goes last
        (the marker that says the folder is complete)."""
        src = self.local / rel
        files = [src] if src.is_file() else sorted((p for p in src.rglob("*") if p.is_file()),
                                                   key=lambda p: (p.name == last, str(p)))
        for p in files:  # one by one: `last` must not land before the rest
            self.fs.put_file(str(p), f"{self.base}/{p.relative_to(self.local).as_posix()}")

    def get(self, rel: str) -> Path:
        """Download the folder `rel` from the store into `local/rel`, replacing what is there."""
        names = self.fs.find(f"{self.base}/{rel}")
        if not names:
            raise ArtifactError(f"{self.url}/{rel} is not in the store")
        dest = self.local / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-get-", dir=dest.parent))
        try:
            self.fs.get(names, [str(tmp / PurePosixPath(n).relative_to(f"{self.base}/{rel}")) for n in names])
            replace_folder(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

    def remove(self, rel: str = "") -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(f"{self.base}/{rel}".rstrip("/"), recursive=True)
