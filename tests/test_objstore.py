"""The artifact store on object storage, against a real S3 API on 127.0.0.1 (moto's server): publishing with
the manifest last, leases, verification on read, and the smoke preset run end to end by two concurrent
runs on S3, artifact for artifact equal to the local-store run."""

import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from test_faults import _killed_at

from helpers import manifest_of, write_config
from moeflow.store.format import ArtifactError
from moeflow.store.lease import Lease
from moeflow.store.local import Manifest
from moeflow.store.remote import ObjectStore
from moeflow.store.url import store_for

DETERMINISTIC = ("ingest", "filter", "dedup", "benchmarks", "decontaminate", "tokenizer", "tokenize",
                 "overlap", "mix", "evaluate")


def _bucket(s3) -> str:
    return s3.bucket(f"b-{uuid.uuid4().hex[:10]}")


def _write(folder: Path, files: int, size: int, seed: int) -> None:
    rng = random.Random(seed)
    for i in range(files):
        (folder / f"part-{i:03d}.bin").write_bytes(rng.randbytes(size))


def test_an_artifact_is_published_manifest_last_and_read_verified(s3, tmp_path, monkeypatch):
    store = ObjectStore(f"{_bucket(s3)}/store")
    assert store.get("mix", "k1") is None
    tmp = store.staging("mix")
    _write(tmp, 3, 1000, 0)
    made = store.commit("mix", "k1", tmp, {"n": 3}, {"stage": "mix"})
    monkeypatch.setenv("MOEFLOW_STORE_CACHE", str(tmp_path / "other-node"))  # another node: an empty mirror
    got = store_for(store.url).get("mix", "k1")
    assert got == made and got.path.startswith(f"{store.url}/mix/mix-k1/data-")
    assert got.dir.is_relative_to(tmp_path / "other-node") and got.lineage()["artifact"]["hash"] == "k1"
    got.verify()
    victim = f"{got.path.removeprefix('s3://')}/part-001.bin"
    data = bytearray(store.fs.cat_file(victim))
    data[10] ^= 1
    store.fs.pipe_file(victim, bytes(data))
    monkeypatch.setenv("MOEFLOW_STORE_CACHE", str(tmp_path / "third-node"))
    with pytest.raises(ArtifactError, match=r"s3://.*/part-001\.bin is missing or does not match.*rerun mix"):
        store_for(store.url).get("mix", "k1").verify()


def test_without_a_kept_mirror_a_process_reads_into_scratch_it_removes(s3, tmp_path):
    url = f"{_bucket(s3)}/store"
    store = ObjectStore(url)
    tmp = store.staging("mix")
    _write(tmp, 2, 100, 0)
    store.commit("mix", "k", tmp, {}, {"stage": "mix"})
    code = ("import sys; from moeflow.store.url import store_for; "
            "d = store_for(sys.argv[1]).get('mix', 'k').dir; print(d); assert (d / 'part-001.bin').exists()")
    out = subprocess.run([sys.executable, "-c", code, url], env={**os.environ, "MOEFLOW_STORE_CACHE": "none"},
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    folder = Path(out.stdout.strip())
    assert "moeflow-mirror-" in str(folder) and not folder.exists()


def test_a_store_url_with_credentials_is_refused_without_echoing_them(tmp_path):
    from moeflow import configs

    cfg = configs.load(str(write_config(tmp_path / "c.yaml", store="s3://AKIAEXAMPLE:s3kr1t@bucket/x")))
    with pytest.raises(ValueError, match="carries credentials") as e:
        cfg.store_url()
    assert "s3kr1t" not in str(e.value)


def test_a_lease_is_held_by_one_writer_and_lapses_when_its_holder_dies(s3):
    store = ObjectStore(f"{_bucket(s3)}/store")
    prefix = f"{store.base}/.leases/x"
    order = []

    def second():
        with Lease(store.fs, prefix, seconds=3):
            order.append("second")

    with Lease(store.fs, prefix, seconds=3):
        t = threading.Thread(target=second)
        t.start()
        time.sleep(4)  # past the lease time: the heartbeat keeps it
        order.append("first done")
    t.join(timeout=30)
    assert order == ["first done", "second"]
    dead = Lease(store.fs, prefix, seconds=2)  # a holder killed: no heartbeat, no release
    dead._try(atomic=True)
    t0 = time.monotonic()
    with Lease(store.fs, prefix, seconds=2):
        waited = time.monotonic() - t0
    assert 0.5 < waited < 10
    with pytest.raises(ArtifactError, match="lost the build lease"):
        dead.check()


def test_a_backend_without_atomic_create_is_named_and_refuses_a_second_writer(caplog):
    from fsspec.implementations.memory import MemoryFileSystem

    class Lax(MemoryFileSystem):  # a backend that ignores the create-if-absent condition
        protocol = "laxmemory"

        def pipe_file(self, path, value, mode="overwrite", **kwargs):
            return super().pipe_file(path, value, **kwargs)

    fs = Lax()
    with Lease(fs, "/lax/lease", seconds=30):
        with pytest.raises(ArtifactError, match="cannot create objects atomically: run one writer"):
            Lease(fs, "/lax/lease", seconds=30).__enter__()
    assert "the laxmemory backend cannot create objects atomically" in caplog.text
    with Lease(fs, "/lax/lease", seconds=30):  # released: one writer at a time is fine
        pass


PUBLISH = """
import random, sys
from pathlib import Path
from moeflow.store.remote import ObjectStore
store = ObjectStore(sys.argv[1])
tmp = store.staging("mix")
rng = random.Random(7)
for i in range(40):
    (tmp / f"part-{i:03d}.bin").write_bytes(rng.randbytes(200_000))
print("staged", flush=True)
store.commit("mix", "k", tmp, {"files": 40}, {"stage": "mix"})
"""


def _read_while_publishing(url: str, stop: threading.Event, seen: list, errors: list) -> None:
    """A reader on another node: whenever the manifest is there, fetch every file it names and check it."""
    import xxhash

    store = ObjectStore(url)
    while not stop.is_set():
        try:
            m = store.get("mix", "k")
            for rel, meta in (m.files if m else {}).items():
                data = store.fs.cat_file(store._remote(m, rel))
                assert (len(data), xxhash.xxh3_64_hexdigest(data)) == (meta["bytes"], meta["xxh3"]), rel
            seen.append(m is not None)
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
            return


@pytest.mark.parametrize("seed", range(4))
def test_sigkill_during_publish_leaves_nothing_a_reader_accepts(s3, tmp_path, monkeypatch, seed):
    url = f"{_bucket(s3)}/store"
    script = tmp_path / "publish.py"
    script.write_text(PUBLISH)
    proc = subprocess.Popen([sys.executable, str(script), url], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout.readline().strip() == "staged"
    stop, seen, errors = threading.Event(), [], []
    reader = threading.Thread(target=_read_while_publishing, args=(url, stop, seen, errors))
    reader.start()
    time.sleep(random.Random(seed).uniform(0, 0.8))  # somewhere in the upload (it takes about a second)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    stop.set()
    reader.join()
    assert errors == [] and seen  # the reader polled throughout and never met a manifest whose files fail
    found = store_for(url).get("mix", "k")
    if found is not None:  # the manifest made it: then every file it names verifies
        monkeypatch.setenv("MOEFLOW_STORE_CACHE", str(tmp_path / "reader"))
        found.verify()
    monkeypatch.setenv("MOEFLOW_STORE_CACHE", str(tmp_path / "rerun"))
    assert subprocess.run([sys.executable, str(script), url], capture_output=True).returncode == 0
    again = store_for(url).get("mix", "k")
    assert again.stats == {"files": 40} and len(again.files) == 40
    if found is not None:
        assert again.content_hash == found.content_hash


def _run(config: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    from prefect.settings import PREFECT_API_URL

    return subprocess.Popen(
        [sys.executable, "-c", "from moeflow.cli import main; raise SystemExit(main())", "run", str(config),
         *args],
        env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )


def _built(summary: dict) -> int:
    return sum(not v["reused"] for v in summary["stages"].values())


@pytest.fixture(scope="module")
def on_s3(s3, prefect_server, smoke_data, tmp_path_factory):
    """Two concurrent runs of the smoke preset with `store: s3://...`, and beside them one into a local store
    (a reference of its own: the session's shared smoke store is rebuilt in part by other tests).
    Returns the URL, the two S3 runs' summaries (the one that built more last) and the local run's."""
    url = f"{_bucket(s3)}/smoke"
    folder = tmp_path_factory.mktemp("cfg")
    config = write_config(folder / "smoke.yaml", store=url)
    local = write_config(folder / "local.yaml", store=str(folder / "store"))
    runs = [_run(config), _run(config), _run(local)]
    for run in runs:
        out, _ = run.communicate(timeout=900)
        assert run.returncode == 0, out[-4000:]
    summaries = sorted(store_for(url).runs(), key=_built)
    return url, summaries, store_for(str(folder / "store")).runs()[-1]


@pytest.mark.check
def test_two_concurrent_runs_on_s3_build_each_artifact_once_equal_to_the_local_run(on_s3):
    url, summaries, local_run = on_s3
    store = store_for(url)
    local = local_run["stages"]
    assert len(summaries) == 2
    for label, entry in summaries[-1]["stages"].items():
        if label in DETERMINISTIC:  # all but where it is, and evaluate's key (it follows train's timings)
            ours, theirs = ({**m, "path": None} for m in (manifest_of(entry), manifest_of(local[label])))
            skip = {"hash": None} if label == "evaluate" else {}
            assert {**ours, **skip} == {**theirs, **skip}, label
    for stage in {*DETERMINISTIC, "train", "card"}:
        assert len(store.fs.glob(f"{store.base}/{stage}/{stage}-*/manifest.json")) == 1, stage
    for label in summaries[-1]["stages"]:  # what one run built, the other reused
        built = [not s["stages"].get(label, {"reused": True})["reused"] for s in summaries]
        assert sum(built) <= 1, label
    train = [manifest_of(s["train"])["files"] for s in (summaries[-1]["stages"], local)]
    for name in ("model.safetensors", "model_config.json"):
        assert train[0][name] == train[1][name]


@pytest.mark.check
def test_nothing_secret_reaches_the_object_store(on_s3):
    url, summaries, _ = on_s3
    store = store_for(url)
    secret = os.environ["AWS_SECRET_ACCESS_KEY"].encode()
    names = store.fs.find(store.base)
    assert len(names) > 50
    texts = [n for n in names if n.endswith((".json", ".jsonl", ".md", ".yaml"))]
    leaked = [n for n in texts if secret in store.fs.cat_file(n)]
    assert leaked == []
    assert summaries[-1]["store"] == url


@pytest.mark.check
def test_a_corrupted_object_is_caught_naming_the_file_and_the_rerun(on_s3, tmp_path, monkeypatch):
    url, summaries, _ = on_s3
    stages = summaries[-1]["stages"]
    store = store_for(url)
    for i, stage in enumerate(("filter", "tokenize", "mix")):
        manifest = Manifest(**manifest_of(stages[stage]))
        rel = max(manifest.files, key=lambda r: manifest.files[r]["bytes"])
        victim = f"{manifest.path.removeprefix('s3://')}/{rel}"
        original = store.fs.cat_file(victim)
        try:
            store.fs.pipe_file(victim, original[: len(original) // 2])
            monkeypatch.setenv("MOEFLOW_STORE_CACHE", str(tmp_path / f"node{i}"))
            with pytest.raises(ArtifactError, match=rf"s3://.*{rel}.*--rerun {stage}"):
                store_for(url).get(stage, manifest.hash).verify()
        finally:
            store.fs.pipe_file(victim, original)


# killed between its data upload and its manifest write (`publish`), or halfway through its records
KILLS_ON_S3 = ("filter@publish", "dedup.join@publish", "tokenize@half", "mix@publish", "train@half")


@pytest.mark.chaos
@pytest.mark.parametrize("spec", KILLS_ON_S3)
def test_sigkill_of_a_run_on_s3_then_rerun_gives_the_same_artifacts(on_s3, s3, tmp_path, spec):
    stage = spec.split("@")[0].split(".")[0]
    url = f"{_bucket(s3)}/chaos"
    config = write_config(tmp_path / "smoke.yaml", store=url)
    _killed_at(_run(config, "--until", stage, env={"MOEFLOW_FAULT": spec}), spec)
    store = store_for(url)
    os.environ["MOEFLOW_STORE_CACHE"], saved = str(tmp_path / "reader"), os.environ["MOEFLOW_STORE_CACHE"]
    try:  # every manifest the killed run left verifies, read from scratch
        for path in store.fs.glob(f"{store.base}/*/*/manifest.json"):
            name = Path(path).parent.name
            store_for(url).get(Path(path).parent.parent.name, name.rsplit("-", 1)[1]).verify()
    finally:
        os.environ["MOEFLOW_STORE_CACHE"] = saved
    out, _ = (rerun := _run(config, "--until", stage)).communicate(timeout=900)
    assert rerun.returncode == 0, out[-4000:]
    ours = store.runs()[-1]["stages"]
    reference = on_s3[1][-1]["stages"]
    for label in [s for s in DETERMINISTIC if s in ours and s != "evaluate"]:
        assert ours[label]["content_hash"] == reference[label]["content_hash"], label
    assert stage in ours
