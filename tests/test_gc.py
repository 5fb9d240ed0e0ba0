"""`moeflow ls` and `moeflow gc`: what a store holds, and removing only what no kept run uses, never while a
run is using the store; on an object store (tests/s3server.py), data no manifest names after its grace period."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path, PurePosixPath

import pytest
from test_objstore import _bucket

from moeflow.cli.main import main
from moeflow.store import gc
from moeflow.store.format import ArtifactError
from moeflow.store.local import Manifest, Store
from moeflow.store.remote import ObjectStore


def _commit(store: Store | ObjectStore, stage: str, key: str, config: str, inputs: dict | None = None) -> Manifest:
    tmp = store.staging(stage)
    (tmp / "data.bin").write_bytes(os.urandom(64))
    lineage = {"run_config": config, "finished_at": "2026-01-01T00:00:00+00:00", "inputs": inputs or {},
               "config": {}, "stage": stage}
    return store.commit(stage, key, tmp, {}, lineage)


def _artifact(store: Store, stage: str, key: str, config: str, inputs: dict | None = None) -> Path:
    return Path(_commit(store, stage, key, config, inputs).path)


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


def _gc_while_running(run: subprocess.Popen, root: Path | str, built) -> dict:
    """Once the run has built something (`built()`), gc: refused with `wait=False`, then waiting for the run."""
    deadline = time.monotonic() + 300
    while not built() and run.poll() is None:
        assert time.monotonic() < deadline, "the run built nothing in 300 s"
        time.sleep(0.5)
    assert run.poll() is None, run.stdout.read()
    said: list[str] = []
    with pytest.raises(ArtifactError, match="in use"):
        gc.gc(root, wait=False, say=said.append)
    done = gc.gc(root, say=said.append)  # waits for the run
    out = run.communicate()[0]
    assert run.returncode == 0, out[-4000:]
    assert any("waiting" in s for s in said), said
    return done


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
    done = _gc_while_running(run, store.root, lambda: list(store.root.glob("ingest*/*/manifest.json")))
    assert done["artifacts"] == 1 and not garbage.exists()
    latest = max((store.root / "runs").glob("*.json"), key=lambda p: p.stat().st_mtime)
    summary = json.loads(latest.read_text())
    for info in summary["stages"].values():
        Manifest.read(Path(info["artifact"])).verify()
    assert {"ingest", "filter", "dedup", "decontaminate"} <= set(summary["stages"])
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert " built " not in again.stdout, again.stdout  # every stage reused


def _prefixes(store: ObjectStore, rel: str) -> list[str]:
    return sorted(p.rsplit("/", 1)[1] for p in store.fs.ls(f"{store.base}/{rel}", detail=False, refresh=True)
                  if "/data-" in p)


def test_ls_lists_an_object_stores_artifacts(s3, capsys):
    store = ObjectStore(f"{_bucket(s3)}/store")
    used = _commit(store, "mix", "k1", "a")
    _commit(store, "ingest", "k2", "b")
    store.record_run({"flow_run_id": "r1", "config": "a", "stages": {"mix": {"artifact": used.path}}})
    assert main(["ls", "--store", store.url]) == 0
    rows = {line.split()[1]: line.split() for line in capsys.readouterr().out.splitlines()[1:-1]}
    assert rows["mix-k1"][0] == "mix" and rows["mix-k1"][-2:] == ["a", "a"]
    assert rows["ingest-k2"][-2:] == ["b", "-"] and len(rows) == 2


@pytest.mark.check  # a launch or several processes against the S3 server: the slower tier
def test_gc_on_an_object_store_removes_superseded_data_after_the_grace_period_not_before(
        s3, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("MOEFLOW_GRACE_SECONDS", "4")
    store = ObjectStore(f"{_bucket(s3)}/store")
    old, new = _commit(store, "mix", "k", "a"), _commit(store, "mix", "k", "a")  # the rerun marks old's data
    unused = _commit(store, "mix", "zz", "a")
    store.fs.pipe_file(f"{store.base}/tokenize/tokenize-dead/data-killed/part.bin", b"x" * 10)  # no manifest
    store.record_run({"flow_run_id": "r1", "config": "a", "stages": {"mix": {"artifact": new.path}}})
    superseded = PurePosixPath(old.path).name
    assert main(["gc", "--store", store.url, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would remove mix/mix-zz" in out
    assert f"keeping superseded mix/mix-k/{superseded}" in out
    assert "keeping superseded tokenize/tokenize-dead/data-killed" in out
    assert store.get("mix", "zz") is not None and not store.fs.exists(f"{store.base}/tokenize/tokenize-dead/"
                                                                      ".superseded/data-killed")  # no marks
    assert main(["gc", "--store", store.url]) == 0  # within the grace period: the artifact only
    assert store.get("mix", "zz") is None and not store.fs.exists(unused.path.removeprefix("s3://"))
    assert _prefixes(store, "mix/mix-k") == sorted([superseded, PurePosixPath(new.path).name])
    assert _prefixes(store, "tokenize/tokenize-dead") == ["data-killed"]
    time.sleep(4.5)
    capsys.readouterr()
    assert main(["gc", "--store", store.url, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would remove superseded mix/mix-k/{superseded}" in out
    assert "would remove superseded tokenize/tokenize-dead/data-killed" in out
    assert main(["gc", "--store", store.url]) == 0
    assert "2 superseded data prefixes: freed" in capsys.readouterr().out
    assert _prefixes(store, "mix/mix-k") == [PurePosixPath(new.path).name]
    assert store.fs.find(f"{store.base}/tokenize") == [] and store.fs.find(f"{store.base}/mix/mix-k/.superseded") == []
    monkeypatch.setenv("MOEFLOW_STORE_CACHE", str(tmp_path / "other-node"))
    store.get("mix", "k").verify()


@pytest.mark.check  # a launch or several processes against the S3 server: the slower tier
def test_gc_on_an_object_store_waits_for_the_runs_using_it_and_runs_wait_for_gc(s3):
    store = ObjectStore(f"{_bucket(s3)}/store")
    order: list[str] = []

    def gc_then(label: str):
        with store.exclusive(say=order.append):
            order.append(label)

    with store.in_use():
        with pytest.raises(ArtifactError, match="in use by a running run"):
            with store.exclusive(wait=False):
                pass
        waiting = threading.Thread(target=gc_then, args=("gc",))
        waiting.start()
        time.sleep(2)
        order.append("run done")
    waiting.join(timeout=30)
    assert order[0].startswith("waiting for the runs") and order[1:] == ["run done", "gc"]

    def run():
        with store.in_use():
            order.append("run")

    with store.exclusive():
        starting = threading.Thread(target=run)
        starting.start()
        time.sleep(2)
        order.append("gc done")
    starting.join(timeout=30)
    assert order[-2:] == ["gc done", "run"]


@pytest.mark.check
def test_gc_on_an_object_store_waits_for_a_run_and_loses_nothing_it_needs(s3, prefect_server, smoke_data,
                                                                          tmp_path):
    """A smoke run (to `dedup`) on S3 in its own process, and gc started while it builds: gc waits for the
    run's lease, then removes the planted garbage only; every artifact the run recorded verifies."""
    from test_objstore import _run

    from helpers import manifest_of, write_config

    store = ObjectStore(f"{_bucket(s3)}/store")
    _commit(store, "mix", "old", "smoke")
    run = _run(write_config(tmp_path / "smoke.yaml", store=store.url), "--until", "dedup")
    done = _gc_while_running(run, store.url, lambda: store.fs.glob(f"{store.base}/ingest*/*/manifest.json"))
    assert done["artifacts"] == 1 and store.get("mix", "old") is None
    stages = store.runs()[-1]["stages"]
    assert {"ingest", "filter", "dedup"} <= set(stages)
    for entry in stages.values():
        Manifest(**manifest_of(entry)).verify()
