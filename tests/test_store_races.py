"""Races on an object store, against the real S3 API of tests/s3server.py: lease renewals that fail, writers
whose leases lapsed publishing at once, readers of an artifact that a forced rerun replaces.

Failures and pauses are injected into one writer's own S3 client through botocore's event hooks (the request
is refused before it is sent, as with an unreachable endpoint); the client, the server and the store code
are the real ones."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from moeflow.store.format import ArtifactError
from moeflow.store.lease import Lease
from moeflow.store.local import Manifest, Store
from moeflow.store.remote import ObjectStore


def _bucket(s3) -> str:
    return s3.bucket(f"b-{uuid.uuid4().hex[:10]}")


def _client(fail=None, pause=None):
    """An S3 filesystem with a client of its own: a PutObject or GetObject for which `fail(params)` holds is
    refused as if the endpoint were unreachable; one for which `pause(params)` holds waits while it does."""
    import s3fs
    from botocore.exceptions import EndpointConnectionError

    fs = s3fs.S3FileSystem(skip_instance_cache=True)

    async def hook(params, **_):
        while pause is not None and pause(params):
            await asyncio.sleep(0.05)
        if fail is not None and fail(params):
            raise EndpointConnectionError(endpoint_url="http://injected-failure")

    for request in ("PutObject", "GetObject"):
        fs.s3.meta.events.register(f"before-parameter-build.s3.{request}", hook)
    return fs


def _renewal(params) -> bool:
    """A lease renewal: an overwrite of a lease generation (taking one is a create: `IfNoneMatch`)."""
    return ".leases/" in params["Key"] and "IfNoneMatch" not in params


def _write(folder: Path, files: int, size: int, seed: int) -> None:
    rng = random.Random(seed)
    for i in range(files):
        (folder / f"part-{i:03d}.bin").write_bytes(rng.randbytes(size))


def test_failed_renewals_are_retried_and_logged_and_the_lease_is_kept(s3, caplog):
    """Renewals fail for a while (shorter than the lease): the holder keeps its lease; a second writer waits."""
    url = _bucket(s3)
    failures = [4]  # the next four renewal requests fail

    def flaky(params) -> bool:
        if _renewal(params) and failures[0] > 0:
            failures[0] -= 1
            return True
        return False

    prefix = f"{url.removeprefix('s3://')}/.leases/x"
    order: list[str] = []

    def second():
        with Lease(_client(), prefix, seconds=6):
            order.append("second")

    with caplog.at_level(logging.WARNING, logger="moeflow.store.lease"):
        with Lease(_client(fail=flaky), prefix, seconds=6):
            t = threading.Thread(target=second)
            t.start()
            time.sleep(12)  # two lease times: without its retried renewals, the lease lapses here
            order.append("first done")
        t.join(timeout=30)
    assert order == ["first done", "second"]
    assert failures == [0] and caplog.text.count("renewing the build lease") >= 4
    assert "EndpointConnectionError" in caplog.text and "retrying in" in caplog.text


def test_a_lease_that_cannot_be_renewed_stops_its_build_at_once(s3):
    """Renewals fail for good: the holder's build is interrupted with LeaseLost once the lease expires, not
    hours later at publish; another writer then takes the lease."""
    url = _bucket(s3)
    prefix = f"{url.removeprefix('s3://')}/.leases/y"
    t0 = time.monotonic()
    with pytest.raises(ArtifactError, match=r"lost the build lease .*renewals failed.*EndpointConnectionError"):
        with Lease(_client(fail=_renewal), prefix, seconds=2):
            for _ in range(600):  # a build: 30 s of steps
                time.sleep(0.05)
    assert time.monotonic() - t0 < 6
    t1 = time.monotonic()
    with Lease(_client(), prefix, seconds=2):
        assert time.monotonic() - t1 < 5


def test_two_writers_whose_leases_lapsed_never_leave_a_manifest_naming_missing_files(s3, tmp_path, monkeypatch):
    """Writer A's renewals fail, so its lease lapses while it pauses just before writing its manifest (after
    its lease check passed); writer B takes the lease, builds and publishes. A's publish must then fail, and
    the manifest in the store must name B's files, all there."""
    url = f"{_bucket(s3)}/store"
    monkeypatch.setenv("MOEFLOW_LEASE_SECONDS", "2")
    published = threading.Event()
    a, b = ObjectStore(url), ObjectStore(url)
    a.fs = _client(fail=_renewal, pause=lambda p: p["Key"].endswith("/manifest.json") and not published.is_set())
    b.fs = _client()
    outcome: dict[str, object] = {}

    def writer(label: str, store: ObjectStore, seed: int, done: threading.Event | None) -> None:
        try:
            with store.lock("mix", "k"):
                tmp = store.staging("mix")
                _write(tmp, 5, 20_000, seed)
                outcome[label] = store.commit("mix", "k", tmp, {}, {"stage": "mix"})
        except ArtifactError as e:
            outcome[label] = e
        finally:
            if done is not None:
                done.set()

    first = threading.Thread(target=writer, args=("a", a, 1, None))
    first.start()
    time.sleep(0.5)  # A holds the lease and is paused at its manifest
    second = threading.Thread(target=writer, args=("b", b, 2, published))
    second.start()
    second.join(timeout=60)
    first.join(timeout=60)
    monkeypatch.setenv("MOEFLOW_STORE_CACHE", str(tmp_path / "reader"))
    found = ObjectStore(url).get("mix", "k")
    found.verify()  # every file it names is there and matches
    assert not isinstance(outcome["b"], Exception), outcome["b"]
    assert isinstance(outcome["a"], ArtifactError) and "published by another writer" in str(outcome["a"])
    assert found.content_hash == outcome["b"].content_hash
    prefixes = [p for p in b.fs.ls(f"{b.base}/mix/mix-k", detail=False, refresh=True) if "/data-" in p]
    assert prefixes == [found.path.removeprefix("s3://")]  # A's unpublished upload went too


def test_a_rerun_keeps_the_old_data_for_the_grace_period_then_drops_it(s3, monkeypatch):
    store = ObjectStore(f"{_bucket(s3)}/store")

    def rerun(seed: int):
        tmp = store.staging("mix")
        _write(tmp, 2, 100, seed)
        return store.commit("mix", "k", tmp, {}, {"stage": "mix"})

    def prefixes() -> list[str]:
        return sorted(p for p in store.fs.ls(f"{store.base}/mix/mix-k", detail=False, refresh=True)
                      if "/data-" in p)

    old, new = rerun(1), rerun(2)
    assert prefixes() == sorted(m.path.removeprefix("s3://") for m in (old, new))
    assert store.get("mix", "k").content_hash == new.content_hash
    monkeypatch.setenv("MOEFLOW_GRACE_SECONDS", "0")
    newest = rerun(3)
    assert prefixes() == [newest.path.removeprefix("s3://")]
    assert store.fs.find(f"{store.base}/mix/mix-k/.superseded") == []  # the marks went with the data


@pytest.mark.parametrize("grace", [None, "0"])
def test_a_reader_downloading_while_a_forced_rerun_publishes_gets_the_old_bytes_or_a_clear_error(
        s3, tmp_path, monkeypatch, grace):
    """A reader on another node has read the manifest and is downloading (its requests held) when a forced
    rerun publishes: with the grace period it finishes with the bytes of the manifest it read; with none, it
    gets the ArtifactError saying what happened, never a raw FileNotFoundError."""
    if grace is not None:
        monkeypatch.setenv("MOEFLOW_GRACE_SECONDS", grace)
    url = f"{_bucket(s3)}/store"
    writer = ObjectStore(url)

    def publish(seed: int):
        tmp = writer.staging("mix")
        _write(tmp, 8, 50_000, seed)
        return writer.commit("mix", "k", tmp, {}, {"stage": "mix"})

    old = publish(0)
    downloading, released = threading.Event(), threading.Event()

    def held(params) -> bool:
        if params["Key"].endswith("/manifest.json"):
            return False
        downloading.set()
        return not released.is_set()

    reader = ObjectStore(url)
    reader.fs, reader.root = _client(pause=held), tmp_path / "reader"
    manifest = reader.get("mix", "k")
    out: dict[str, object] = {}

    def read() -> None:
        try:
            out["folder"] = reader.pull(manifest)  # verified file by file as it arrives
        except Exception as e:  # noqa: BLE001 - reported below
            out["error"] = e

    t = threading.Thread(target=read)
    t.start()
    assert downloading.wait(30)
    new = publish(1)  # the forced rerun
    released.set()
    t.join(timeout=60)
    assert new.content_hash != old.content_hash
    if grace is None:
        assert "error" not in out, out.get("error")
        for rel, meta in old.files.items():
            assert (out["folder"] / rel).stat().st_size == meta["bytes"]
        assert Manifest.read(out["folder"]).content_hash == old.content_hash
    else:
        assert isinstance(out.get("error"), ArtifactError), out
        assert "was replaced (a rerun published a new version of mix-k)" in str(out["error"])


def test_a_local_reader_of_an_artifact_a_rerun_replaced_is_told_so(tmp_path):
    """In a local store a rerun swaps the artifact's folder in place: a reader still holding the old manifest
    gets an error saying the artifact was replaced, not one calling it corrupt."""
    store = Store(tmp_path / "store")
    made = []
    for seed in (1, 2):
        tmp = store.staging("mix")
        _write(tmp, 2, 100, seed)
        made.append(store.commit("mix", "k", tmp, {}, {"stage": "mix"}))
    with pytest.raises(ArtifactError, match=r"was replaced \(a rerun published a new version of mix-k"):
        made[0].verify()
    made[1].verify()

@pytest.mark.parametrize("rerun", ["mid-swap", "swapped"])
def test_a_stage_reading_a_local_artifact_that_a_rerun_replaces_is_told_so(tmp_path, monkeypatch, rerun):
    """A rerun republishes the documents a stage has verified and is about to read, its commit paused with
    the old folder moved aside and the new one not yet in place (`mid-swap`), or done, the new documents as
    many as the old (`swapped`): the stage fails with the error saying the artifact was replaced, never a
    raw FileNotFoundError, nor an artifact built from other bytes than its lineage names; nothing is published."""
    from moeflow import configs
    from moeflow.core import faults
    from moeflow.core.documents import DocWriter
    from moeflow.tasks.runner import materialize

    cfg = configs.load("smoke", store=str(tmp_path / "store"))
    store = Store(cfg.store_path())

    def publish(tag: str) -> Manifest:
        tmp = store.staging("filter")
        with DocWriter(tmp, rows_per_group=2) as writer:
            for i in range(6):
                writer.write({"id": f"s/{tag}{i}", "source": "s", "domain": "d", "path": "p",
                              "text": f"{tag} {i} " + "the quick brown fox jumps over the lazy dog " * 8})
        stats = {"documents_in": 6, "documents_out": 6, "fates": {"kept": 6}}
        return store.commit("filter", "k", tmp, stats, {"stage": "filter", "config": {}, "inputs": {},
                                                        "finished_at": "t", "started_at": "t"})

    docs = publish("old")
    aside, release, real_replace, real_at = threading.Event(), threading.Event(), os.replace, faults.at
    rerun_thread = threading.Thread(target=publish, args=("new",))

    def replace(src, dst):  # the rerun's commit pauses once the old folder is out of the way
        real_replace(src, dst)
        if threading.current_thread() is rerun_thread and str(dst).endswith(".old"):
            aside.set()
            release.wait(10)

    republished = []

    def at(point: str) -> None:  # verified, about to read: the rerun publishes (once)
        if point == "inputs" and not republished:
            republished.append(rerun)
            if rerun == "mid-swap":
                rerun_thread.start()
                assert aside.wait(10)
            else:
                publish("new")
        real_at(point)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(faults, "at", at)
    try:
        with pytest.raises(ArtifactError, match=r"filter-k was replaced \(a rerun published a new version of "
                                                rf"filter-k, content {docs.content_hash} -> "):
            materialize("filter", cfg, {"docs": docs})
    finally:
        release.set()
        if rerun_thread.is_alive():
            rerun_thread.join(10)
    # the input is filter-k, beside any output of this filter stage
    assert not list((tmp_path / "store" / "filter").glob("filter-[!k]*")), "nothing may be published"


def test_a_forced_rerun_commits_without_waiting_for_the_old_folder_to_be_deleted(tmp_path, monkeypatch):
    """A local rerun's commit swaps the new folder in and returns; the replaced one (renamed out of every
    reader's way) is deleted on a thread of its own, and until it is gone `moeflow gc` counts it stale."""
    import shutil

    from moeflow.store import gc

    store = Store(tmp_path / "store")
    release, real = threading.Event(), shutil.rmtree

    def held(path, *args, **kwargs):  # deleting a replaced folder waits for the test
        if str(path).endswith(".old"):
            assert release.wait(5), "the commit waited for the replaced folder's deletion"
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", held)
    made = []
    for seed in (1, 2):
        tmp = store.staging("mix")
        _write(tmp, 2, 100, seed)
        made.append(store.commit("mix", "k", tmp, {}, {"stage": "mix"}))
    assert Manifest.read(store.folder("mix", "k")).content_hash == made[1].content_hash
    (old,) = gc.stale(store.root)
    assert old.name.startswith(".mix-k.") and (old / "manifest.json").exists()
    release.set()
    for t in [t for t in threading.enumerate() if t.name.startswith("discard ")]:
        t.join(10)
    assert not old.exists() and not gc.stale(store.root)


def test_a_run_record_is_read_back_from_the_store_by_a_process_without_a_mirror(s3, tmp_path):
    """`moeflow up` with an object store and `MOEFLOW_STORE_CACHE=none`: the worker's process records the run
    (its scratch mirror goes when it exits), then the CLI's process reads the record back, as `up` does."""
    url = f"{_bucket(s3)}/store"
    env = {**os.environ, "MOEFLOW_STORE_CACHE": "none", "MOEFLOW_STORE": url}
    worker = ("from moeflow.store.url import store_for; import sys; store_for(sys.argv[1]).record_run("
              "{'flow_run_id': 'run-1', 'config': 'smoke', 'card': 'README.md', 'stages': {}})")
    done = subprocess.run([sys.executable, "-c", worker, url], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    cli = ("from moeflow import configs; from moeflow.store.url import store_for; "
           "print(store_for(configs.load('smoke').store_url()).run('run-1')['card'])")
    read = subprocess.run([sys.executable, "-c", cli], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert read.returncode == 0, read.stderr
    assert read.stdout.strip() == "README.md"
    missing = subprocess.run([sys.executable, "-c", cli.replace("run-1", "run-2")], env=env,
                             capture_output=True, text=True)
    assert "has no record of flow run run-2" in missing.stderr and "ArtifactError" in missing.stderr


@pytest.mark.e2e
@pytest.mark.check
def test_moeflow_up_on_an_object_store_without_a_mirror_prints_the_card(s3, smoke_data, tmp_path):
    """The real thing: `moeflow up smoke` with `MOEFLOW_STORE=s3://...` and `MOEFLOW_STORE_CACHE=none` runs the
    smoke deployment through a server and worker and ends printing the card path, exit 0."""
    url = f"{_bucket(s3)}/up"
    env = {**os.environ, "MOEFLOW_STORE_CACHE": "none", "MOEFLOW_STORE": url}
    up = subprocess.run([sys.executable, "-m", "moeflow.cli", "up", "smoke", "--home", str(tmp_path / "home")],
                        env=env, capture_output=True, text=True, timeout=1200)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    assert up.stdout.strip().splitlines()[-1].endswith("README.md"), up.stdout[-2000:]
