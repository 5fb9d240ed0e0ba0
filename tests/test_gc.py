"""`moeflow ls` and `moeflow gc`: what a store holds, and removing only what no kept run uses, never while a
run is using the store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moeflow.store import gc
from moeflow.store.local import Manifest, Store


def _artifact(store: Store, stage: str, key: str, config: str, inputs: dict | None = None) -> Path:
    tmp = store.staging(stage)
    (tmp / "data.bin").write_bytes(os.urandom(64))
    lineage = {"run_config": config, "finished_at": "2026-01-01T00:00:00+00:00", "inputs": inputs or {},
               "config": {}, "stage": stage}
    return Path(store.commit(stage, key, tmp, {}, lineage).path)


def _run_record(store: Store, name: str, config: str, artifacts: list[Path]) -> None:
    (store.root / "runs").mkdir(exist_ok=True)
    stages = {p.parent.name: {"artifact": str(p)} for p in artifacts}
    (store.root / "runs" / f"{name}.json").write_text(json.dumps({"config": config, "stages": stages}))
    time.sleep(0.01)  # run records are ordered by mtime


def test_gc_keeps_what_kept_runs_use_and_their_upstream(tmp_path):
    store = Store(tmp_path / "store")
    a_old = _artifact(store, "ingest", "a1", "a")
    a_new = _artifact(store, "ingest", "a2", "a")
    a_up = _artifact(store, "filter", "a3", "a", {"docs": {"path": "ingest/ingest-a2"}})
    b = _artifact(store, "ingest", "b1", "b")
    orphan = _artifact(store, "mix", "zz", "c")
    _run_record(store, "r1", "a", [a_old])
    _run_record(store, "r2", "a", [a_up])  # reaches a_new through its lineage inputs
    _run_record(store, "r3", "b", [b])
    leftover = store.staging("filter")  # a dead writer's staging folder
    rows = {r[1]: r for r in gc.listing(store.root)}
    assert rows["ingest-a1"][5] == "-" and rows["ingest-a2"][5] == "a" and rows["ingest-b1"][5] == "b"
    assert gc.gc(store.root, dry_run=True, say=lambda _: None)["artifacts"] == 2
    assert a_old.exists() and orphan.exists() and leftover.exists()  # a dry run removes nothing
    done = gc.gc(store.root, say=lambda _: None)
    assert (done["artifacts"], done["stale"]) == (2, 1)
    assert not a_old.exists() and not orphan.exists() and not leftover.exists()
    for kept in (a_new, a_up, b):
        Manifest.read(kept).verify()
    assert gc.gc(store.root, keep_latest=0, older_than=gc.parse_age("10000w"),
                           say=lambda _: None)["artifacts"] == 0  # nothing that old
    with pytest.raises(ValueError, match="unit"):
        gc.parse_age("7 days")


@pytest.mark.check
def test_gc_waits_for_a_run_and_loses_nothing_it_needs(prefect_server, smoke_data, tmp_path):
    """A real smoke run (to `decontaminate`) in its own process, and gc started while it builds: gc waits
    for the run's store lock, then removes the planted garbage only; every artifact the run recorded
    verifies, and a rerun reuses all."""
    from prefect.settings import PREFECT_API_URL

    from helpers import write_config

    store = Store(tmp_path / "store")
    garbage = _artifact(store, "mix", "old", "smoke")
    cfg = write_config(tmp_path / "smoke.yaml", store=str(store.root))
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}  # the tests' server
    cmd = [sys.executable, "-m", "moeflow.cli", "run", str(cfg), "--until", "decontaminate"]
    run = subprocess.Popen(cmd, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not list(store.root.glob("ingest*/*/manifest.json")) and run.poll() is None:
        assert time.monotonic() < deadline, "the run built nothing in 300 s"
        time.sleep(0.5)
    assert run.poll() is None, run.stdout.read()
    said: list[str] = []
    with pytest.raises(Exception, match="in use"):
        gc.gc(store.root, wait=False, say=said.append)
    done = gc.gc(store.root, say=said.append)  # waits for the run
    out = run.communicate()[0]
    assert run.returncode == 0, out
    assert any("waiting" in s for s in said), said
    assert done["artifacts"] == 1 and not garbage.exists()
    latest = max((store.root / "runs").glob("*.json"), key=lambda p: p.stat().st_mtime)
    summary = json.loads(latest.read_text())
    for info in summary["stages"].values():
        Manifest.read(Path(info["artifact"])).verify()
    assert {"ingest", "filter", "dedup", "decontaminate"} <= set(summary["stages"])
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert " built " not in again.stdout, again.stdout  # every stage reused
