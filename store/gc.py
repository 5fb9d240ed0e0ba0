"""Store housekeeping: `moeflow ls` lists the artifacts, `moeflow gc` removes those no kept run uses.

Every run holds the store's run lock shared for as long as it runs (`in_use`: a `flock` on a local store,
a lease of the run's own on an object store); gc takes it exclusively, so it never removes anything while a
run is building or reusing artifacts: it waits for the active runs to end (or, with `wait=False`, stops and
says so). With the lock held no writer is alive, so leftover staging folders (`.<stage>-tmp-*`,
`.<name>.old`) are stale and go too. A run's resumable training work (`.<name>.work`) is kept: it is what a
rerun of that config resumes from. On an object store the leftovers are data prefixes no manifest names (a
rerun's predecessor, a killed writer's upload): gc marks them as a publish does and removes them once marked
for `MOEFLOW_GRACE_SECONDS`, so a reader that read an old manifest elsewhere finishes first.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path, PurePosixPath

from moeflow.store.format import MANIFEST, is_remote
from moeflow.store.local import Store
from moeflow.store.remote import ObjectStore, grace_seconds
from moeflow.store.url import store_for

AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
SKIP = ("runs", "openlineage")  # folders of the store that hold no artifacts


@dataclass
class Entry:
    """One stored artifact: where, how big, when, from which config, its inputs, and which configs' kept runs
    use it."""

    stage: str
    name: str
    bytes: int
    finished_at: datetime
    config: str
    inputs: list[str]  # the inputs' `<stage>/<name>`
    used_by: list[str] = field(default_factory=list)

    @property
    def rel(self) -> str:
        return f"{self.stage}/{self.name}"


@dataclass
class Leftover:
    """What a dead writer or a rerun left: `wait` seconds before gc may remove it (0: now)."""

    rel: str
    bytes: int
    what: str
    wait: float = 0.0


class Folders:
    """A local store's artifacts and leftovers, as folders."""

    def __init__(self, store: Store):
        self.store, self.root = store, store.root

    def artifacts(self) -> Iterator[tuple[str, str, int]]:
        """(stage, name, bytes) of every folder with a manifest."""
        for manifest in self.root.glob(f"*/*/{MANIFEST}"):
            folder = manifest.parent
            if not folder.name.startswith(".") and folder.parent.name not in SKIP:
                yield folder.parent.name, folder.name, _size(folder)

    def remove(self, e: Entry) -> None:
        """Rename the artifact out of sight, then delete it and its build lock."""
        path = self.root / e.rel
        gone = path.with_name(f".{e.name}.gc")
        os.replace(path, gone)
        shutil.rmtree(gone)
        (path.parent / f".{e.name}.lock").unlink(missing_ok=True)

    def leftovers(self, skip: set[str], mark: bool) -> list[Leftover]:
        return [Leftover(p.relative_to(self.root).as_posix(), _size(p), "stale") for p in stale(self.root)]

    def drop(self, x: Leftover) -> None:
        shutil.rmtree(self.root / x.rel, ignore_errors=True)


class Prefixes:
    """An object store's artifacts and leftovers, as prefixes (listed through fsspec)."""

    def __init__(self, store: ObjectStore):
        self.store = store

    def _objects(self) -> dict[tuple[str, str], dict[str, int]]:
        """(stage, name) -> the sizes of the objects under each artifact's prefix, by their path below it."""
        found: dict[tuple[str, str], dict[str, int]] = {}
        for path, info in self.store.fs.find(self.store.base, detail=True).items():
            parts = PurePosixPath(path).relative_to(self.store.base).parts
            if len(parts) > 2 and parts[0] not in SKIP and not parts[0].startswith(".") \
                    and not parts[1].startswith("."):
                found.setdefault(parts[:2], {})["/".join(parts[2:])] = info["size"]
        return found

    def artifacts(self) -> Iterator[tuple[str, str, int]]:
        """(stage, name, bytes) of every prefix with a manifest."""
        for (stage, name), sizes in self._objects().items():
            if MANIFEST in sizes:
                yield stage, name, sum(sizes.values())

    def remove(self, e: Entry) -> None:
        """Delete the manifest first (no reader accepts the rest from then), then the prefix and its leases."""
        fs, base = self.store.fs, self.store.base
        fs.rm(f"{base}/{e.rel}/{MANIFEST}")
        fs.rm(f"{base}/{e.rel}", recursive=True)
        with contextlib.suppress(FileNotFoundError):
            fs.rm(f"{base}/{e.stage}/.leases/{e.name}", recursive=True)

    def leftovers(self, skip: set[str], mark: bool) -> list[Leftover]:
        """The data prefixes no manifest names, of every artifact but those in `skip`; each first seen now is
        marked (with `mark`), and may go once marked for the grace period."""
        out, grace = [], grace_seconds()
        for (stage, name), sizes in self._objects().items():
            if f"{stage}/{name}" in skip:
                continue
            manifest = self.store.get(stage, name[len(stage) + 1:]) if MANIFEST in sizes else None
            keep = PurePosixPath(manifest.path).name if manifest else None
            for path, since in self.store.superseded(stage, name, keep, mark).items():
                leaf = PurePosixPath(path).name
                out.append(Leftover(f"{stage}/{name}/{leaf}",
                                    sum(n for rel, n in sizes.items() if rel.startswith(f"{leaf}/")),
                                    "superseded", max(0.0, since + grace - time.time())))
        return out

    def drop(self, x: Leftover) -> None:
        self.store.drop(f"{self.store.base}/{x.rel}")


def housekeeper(root: Path | str) -> Folders | Prefixes:
    """The store at `root` (a folder or an fsspec URL), seen as gc sees it."""
    store = store_for(root)
    return Prefixes(store) if isinstance(store, ObjectStore) else Folders(store)


def parse_age(text: str) -> timedelta:
    """`30m`, `12h`, `7d`, `2w` as a timedelta; a clear error otherwise."""
    m = AGE.match(text.strip())
    if not m:
        raise ValueError(f"age {text!r}: write a number and a unit (s, m, h, d, w), e.g. 7d or 12h")
    return timedelta(**{UNITS[m.group(2)]: float(m.group(1))})


def entries(where: Folders | Prefixes) -> list[Entry]:
    """Every complete artifact in the store (one with a manifest), oldest first."""
    out = []
    for stage, name, size in where.artifacts():
        rec = where.store.get(stage, name[len(stage) + 1:]).lineage()
        out.append(Entry(stage, name, size, datetime.fromisoformat(rec["finished_at"]),
                         rec.get("run_config") or "-", [inp["path"] for inp in rec["inputs"].values()]))
    return sorted(out, key=lambda e: (e.finished_at, e.stage, e.name))


def kept_runs(store: Store | ObjectStore, keep_latest: int) -> dict[str, list[dict]]:
    """Config name -> its `keep_latest` newest run records."""
    runs: dict[str, list[dict]] = {}
    for summary in store.runs():
        runs.setdefault(summary["config"], []).append(summary)
    return {c: rs[-keep_latest:] if keep_latest else [] for c, rs in runs.items()}


def mark_used(store: Store | ObjectStore, found: list[Entry], keep_latest: int) -> None:
    """Fill each entry's `used_by`: the configs whose kept runs use it, or an artifact upstream of one."""
    by_rel = {e.rel: e for e in found}
    for config, runs in kept_runs(store, keep_latest).items():
        todo = [_rel(s["artifact"]) for run in runs for s in run["stages"].values()]
        seen: set[str] = set()
        while todo:
            rel = todo.pop()
            if rel in seen or rel not in by_rel:
                continue
            seen.add(rel)
            if config not in by_rel[rel].used_by:
                by_rel[rel].used_by.append(config)
            todo += by_rel[rel].inputs


def _rel(artifact: str) -> str:
    """A run record's artifact (a folder, or an object store's data prefix) as `<stage>/<name>`."""
    path = PurePosixPath(artifact)
    return "/".join((path.parent if is_remote(artifact) else path).parts[-2:])


def stale(root: Path) -> list[Path]:
    """Staging and replaced folders writers left behind (stale once no run holds the store)."""
    return sorted(p for pattern in ("*/.*-tmp-*", "*/.*.old", "*/.*.gc") for p in root.glob(pattern)
                  if p.is_dir())


def plan(where: Folders | Prefixes, keep_latest: int = 1, older_than: timedelta | None = None) -> list[Entry]:
    """The artifacts gc would remove: used by no kept run, and older than `older_than` when given."""
    found = entries(where)
    mark_used(where.store, found, keep_latest)
    now = datetime.now(UTC)
    return [e for e in found if not e.used_by and (older_than is None or now - e.finished_at > older_than)]


def gc(root: Path | str, keep_latest: int = 1, older_than: timedelta | None = None, dry_run: bool = False,
       wait: bool = True, say=print) -> dict:
    """Remove what `plan` names and the leftovers due, holding the store's run lock exclusively (with
    `dry_run`, say what would go and remove nothing)."""
    where = housekeeper(root)
    with where.store.exclusive(wait=wait, say=say):
        doomed = plan(where, keep_latest, older_than)
        leftovers = where.leftovers({e.rel for e in doomed}, mark=not dry_run)
        due = [x for x in leftovers if not x.wait]
        verb = "would remove" if dry_run else "removing"
        for e in doomed:
            say(f"{verb} {e.rel} ({_human(e.bytes)}, config {e.config})")
            if not dry_run:
                where.remove(e)
        for x in leftovers:
            if x.wait:
                say(f"keeping {x.what} {x.rel} ({_human(x.bytes)}) for its grace period: {_age(x.wait)} left")
                continue
            say(f"{verb} {x.what} {x.rel}")
            if not dry_run:
                where.drop(x)
    return {"artifacts": len(doomed), "stale": len(due), "bytes": sum(x.bytes for x in [*doomed, *due]),
            "dry_run": dry_run}


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def listing(root: Path | str, stage: str | None = None, keep_latest: int = 1) -> list[list[str]]:
    """Rows for `moeflow ls`: stage, artifact, size, age, config, used by (kept runs' configs)."""
    where = housekeeper(root)
    found = entries(where)
    mark_used(where.store, found, keep_latest)
    now = datetime.now(UTC)
    return [[e.stage, e.name, _human(e.bytes), _age((now - e.finished_at).total_seconds()), e.config,
             ", ".join(sorted(e.used_by)) or "-"] for e in found if stage in (None, e.stage)]


def _age(s: float) -> str:
    for size, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if s >= size:
            return f"{s / size:.0f}{unit}"
    return f"{s:.0f}s"
