"""Store housekeeping: `moeflow ls` lists the artifacts, `moeflow gc` removes those no kept run uses.

Every run holds the store's run lock shared for as long as it runs (`Store.in_use`); gc takes it
exclusively, so it never removes anything while a run is building or reusing artifacts: it waits for the
active runs to end (or, with `wait=False`, stops and says so). With the lock held no writer is alive, so
leftover staging folders (`.<stage>-tmp-*`, `.<name>.old`) are stale and go too. A run's resumable
training work (`.<name>.work`) is kept: it is what a rerun of that config resumes from.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from moeflow.store.format import LINEAGE, MANIFEST
from moeflow.store.local import Store

AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


@dataclass
class Entry:
    """One stored artifact: where, how big, when, from which config, and which configs' kept runs use it."""

    stage: str
    path: Path
    bytes: int
    finished_at: datetime
    config: str
    used_by: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.name


def parse_age(text: str) -> timedelta:
    """`30m`, `12h`, `7d`, `2w` as a timedelta; a clear error otherwise."""
    m = AGE.match(text.strip())
    if not m:
        raise ValueError(f"age {text!r}: write a number and a unit (s, m, h, d, w), e.g. 7d or 12h")
    return timedelta(**{UNITS[m.group(2)]: float(m.group(1))})


def entries(root: Path) -> list[Entry]:
    """Every complete artifact in the store (a folder with a manifest), oldest first."""
    out = []
    for manifest in root.glob(f"*/*/{MANIFEST}"):
        folder = manifest.parent
        if folder.name.startswith(".") or folder.parent.name in ("runs", "openlineage"):
            continue
        rec = json.loads((folder / LINEAGE).read_text())
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        out.append(Entry(folder.parent.name, folder, size, datetime.fromisoformat(rec["finished_at"]),
                         rec.get("run_config") or "-"))
    return sorted(out, key=lambda e: (e.finished_at, e.stage, e.name))


def kept_runs(root: Path, keep_latest: int) -> dict[str, list[dict]]:
    """Config name -> its `keep_latest` newest run records."""
    runs: dict[str, list[dict]] = {}
    for summary in Store(root).runs():
        runs.setdefault(summary["config"], []).append(summary)
    return {c: rs[-keep_latest:] if keep_latest else [] for c, rs in runs.items()}


def mark_used(root: Path, found: list[Entry], keep_latest: int) -> None:
    """Fill each entry's `used_by`: the configs whose kept runs use it, or an artifact upstream of one."""
    by_path = {e.path: e for e in found}
    for config, runs in kept_runs(root, keep_latest).items():
        todo = [Path(s["artifact"]) for run in runs for s in run["stages"].values()]
        seen: set[Path] = set()
        while todo:
            path = todo.pop()
            if path in seen or path not in by_path:
                continue
            seen.add(path)
            if config not in by_path[path].used_by:
                by_path[path].used_by.append(config)
            rec = json.loads((path / LINEAGE).read_text())
            todo += [root / inp["path"] for inp in rec["inputs"].values()]


def stale(root: Path) -> list[Path]:
    """Staging and replaced folders writers left behind (stale once no run holds the store)."""
    return sorted(p for pattern in ("*/.*-tmp-*", "*/.*.old", "*/.*.gc") for p in root.glob(pattern)
                  if p.is_dir())


def plan(root: Path, keep_latest: int = 1, older_than: timedelta | None = None) -> list[Entry]:
    """The artifacts gc would remove: used by no kept run, and older than `older_than` when given."""
    found = entries(root)
    mark_used(root, found, keep_latest)
    now = datetime.now(UTC)
    return [e for e in found if not e.used_by and (older_than is None or now - e.finished_at > older_than)]


def gc(root: Path, keep_latest: int = 1, older_than: timedelta | None = None, dry_run: bool = False,
       wait: bool = True, say=print) -> dict:
    """Remove what `plan` names and the stale staging folders, holding the store's run lock exclusively
    (none with `dry_run`). Each artifact is renamed out of sight first, then deleted."""
    store = Store(root)
    with store.exclusive(wait=wait, say=say):
        doomed, leftovers = plan(store.root, keep_latest, older_than), stale(store.root)
        freed = sum(e.bytes for e in doomed) + sum(_size(p) for p in leftovers)
        for e in doomed:
            say(f"{'would remove' if dry_run else 'removing'} {e.stage}/{e.name} ({_human(e.bytes)}, "
                f"config {e.config})")
            if not dry_run:
                gone = e.path.with_name(f".{e.name}.gc")
                os.replace(e.path, gone)
                shutil.rmtree(gone)
                (e.path.parent / f".{e.name}.lock").unlink(missing_ok=True)
        for p in leftovers:
            say(f"{'would remove' if dry_run else 'removing'} stale {p.relative_to(store.root)}")
            if not dry_run:
                shutil.rmtree(p, ignore_errors=True)
    return {"artifacts": len(doomed), "stale": len(leftovers), "bytes": freed, "dry_run": dry_run}


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def listing(root: Path, stage: str | None = None, keep_latest: int = 1) -> list[list[str]]:
    """Rows for `moeflow ls`: stage, artifact, size, age, config, used by (kept runs' configs)."""
    found = entries(root)
    mark_used(root, found, keep_latest)
    now = datetime.now(UTC)
    return [[e.stage, e.name, _human(e.bytes), _age(now - e.finished_at), e.config,
             ", ".join(sorted(e.used_by)) or "-"] for e in found if stage in (None, e.stage)]


def _age(d: timedelta) -> str:
    s = d.total_seconds()
    for size, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if s >= size:
            return f"{s / size:.0f}{unit}"
    return f"{s:.0f}s"
