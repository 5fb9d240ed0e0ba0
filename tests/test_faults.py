"""Fault tolerance: concurrent runs build each artifact once; SIGKILL inside a stage, then a rerun, gives
the uninterrupted run's artifacts; two cold runs give identical data, token and model artifacts.

Runs are real `moeflow run` processes against the session's Prefect server. The kill tests are marked
`chaos` (slow): `make chaos` runs them, `make test` leaves them out; the 2 GB source test is `big` (`make big`).
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import write_config

DETERMINISTIC = (
    "ingest",
    "filter",
    "dedup",
    "benchmarks",
    "decontaminate",
    "tokenizer",
    "tokenize",
    "overlap",
    "mix",
    "evaluate",
)


def _start(config: Path, *args: str, preexec_fn=None, env: dict | None = None) -> subprocess.Popen:
    """`moeflow run CONFIG ARGS` against the session's server, in its own process group, output merged;
    `preexec_fn` runs in the child before it execs (a resource limit, joining a cgroup); `env` adds to its
    environment."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), **(env or {})}
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from moeflow.cli import main; raise SystemExit(main())",
            "run",
            str(config),
            *args,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=preexec_fn,
    )


def _finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def _artifacts(store: Path) -> dict[str, list[dict]]:
    """stage -> the lineage of every artifact of it in the store."""
    return {
        p.name: [json.loads(f.read_text()) for f in sorted(p.glob(f"{p.name}-*/lineage.json"))]
        for p in sorted(store.iterdir())
        if p.is_dir() and not p.name.startswith(".")
    }


def _content(store: Path) -> dict[str, str]:
    """stage -> content hash of the latest run's artifact of it."""
    latest = max((store / "runs").glob("*.json"), key=lambda p: p.stat().st_mtime)
    return {k: v["content_hash"] for k, v in json.loads(latest.read_text())["stages"].items() if "[" not in k}


@pytest.fixture(scope="module")
def reference(prefect_server, smoke_data, tmp_path_factory):
    """An uninterrupted cold run of the smoke preset (in a process, like the runs it is compared with)."""
    store = tmp_path_factory.mktemp("reference")
    config = write_config(tmp_path_factory.mktemp("cfg") / "smoke.yaml", store=str(store))
    _finish(_start(config))
    return store


@pytest.mark.check
def test_two_concurrent_runs_build_each_artifact_once(reference, tmp_path):
    store = tmp_path / "store"
    config = write_config(tmp_path / "smoke.yaml", store=str(store))
    runs = [_start(config, "--until", "tokenize"), _start(config, "--until", "tokenize")]
    for run in runs:
        _finish(run)
    built = _artifacts(store)
    for stage in ("ingest", "filter", "dedup", "benchmarks", "decontaminate", "tokenizer", "tokenize"):
        assert len(built[stage]) == 1, stage
    events = [json.loads(line) for line in (store / "openlineage" / "events.jsonl").read_text().splitlines()]
    completed = [d["name"] for e in events if e["eventType"] == "COMPLETE" for d in e["outputs"]]
    assert sorted(completed) == sorted(set(completed))  # no artifact completed twice
    ours, ref = _content(store), _content(reference)
    assert ours == {k: ref[k] for k in ours}


def _comparable(store: Path, until: str | None = None) -> dict:
    """What must equal between runs: the content hashes of the deterministic stages (those up to `until`,
    in flow order), and train's weights, model config and loss curve (its artifact also holds timings:
    tokens/s, TensorBoard event files) when the run trained."""
    latest = max((store / "runs").glob("*.json"), key=lambda p: p.stat().st_mtime)
    stages = json.loads(latest.read_text())["stages"]
    upto = DETERMINISTIC if until in (None, "train") else DETERMINISTIC[: DETERMINISTIC.index(until) + 1]
    out = {s: stages[s]["content_hash"] for s in upto if s != "evaluate" or until is None}
    if until not in (None, "train"):
        return out
    folder = Path(stages["train"]["artifact"])
    files = json.loads((folder / "manifest.json").read_text())["files"]
    curve = [
        (r["step"], r["ce"], r["grad_norm"])
        for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
    ]
    return {
        **out,
        "train weights": files["model.safetensors"]["xxh3"],
        "train config": files["model_config.json"]["xxh3"],
        "train curve": curve,
    }


@pytest.mark.check
def test_a_second_cold_run_gives_identical_artifacts(reference, tmp_path):
    store = tmp_path / "store"
    _finish(_start(write_config(tmp_path / "smoke.yaml", store=str(store))))
    assert _comparable(store) == _comparable(reference)
    from moeflow.card import RUN_RECORD

    cards = []
    for root in (store, reference):
        latest = max((root / "runs").glob("*.json"), key=lambda p: p.stat().st_mtime)
        text = Path(json.loads(latest.read_text())["card"]).read_text()
        assert text.count(RUN_RECORD) == 1
        cards.append(text.split(RUN_RECORD)[0])  # what differs between runs is kept below this heading
    assert cards[0] == cards[1]


# `make chaos`: every stage and phase the smoke preset builds, each at named points of the runner
# (`core.faults`): after its inputs are verified, halfway through its records, after its files are
# written (no manifest), sealed but not renamed into place, after it is published (not yet in the run
# record); then seeded fractions
KILL_POINTS = (
    "ingest.shard@half", "ingest.join@written",
    "filter@half", "filter@committed",
    "dedup.sign@half", "dedup.pairs@written", "dedup.clusters@inputs", "dedup.join@committed",
    "decontaminate@half", "decontaminate@publish",
    "tokenize@half", "tokenize@written",
    "mix@written",
    "train@half", "train@committed",
)
SEEDED = ("ingest", "train")  # a fraction drawn from the seed: points between the named ones


def _killed_at(proc: subprocess.Popen, spec: str, timeout: float = 600) -> str:
    """The run's output, once it has SIGKILLed its own process group at `spec`; a run that ended any other
    way fails here with its own log."""
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != -signal.SIGKILL or f"MOEFLOW_FAULT={spec}: SIGKILL" not in out:
        pytest.fail(f"the run was to kill itself at {spec} but exited with status {proc.returncode}; "
                    f"its log:\n{out[-6000:]}")
    return out


def _kill_then_rerun(reference: Path, tmp_path: Path, spec: str) -> None:
    """Run until the stage of `spec`, killed at its point; run again until that stage: the same artifacts as
    the uninterrupted run's, and what the killed run finished reused."""
    stage = spec.split("@")[0].split(":")[0].split(".")[0]
    store = tmp_path / "store"
    config = write_config(tmp_path / "smoke.yaml", store=str(store))
    _killed_at(_start(config, "--until", stage, env={"MOEFLOW_FAULT": spec}), spec)
    before = {s: [a["artifact"]["hash"] for a in arts] for s, arts in _artifacts(store).items()}
    for arts in _artifacts(store).values():  # nothing half-written was published
        for a in arts:
            manifest = store / a["stage"] / f"{a['stage']}-{a['artifact']['hash']}" / "manifest.json"
            assert manifest.exists()
    _finish(_start(config, "--until", stage))
    assert _comparable(store, stage) == {k: v for k, v in _comparable(reference).items()
                                         if k in _comparable(store, stage)}
    latest = max((store / "runs").glob("*.json"), key=lambda p: p.stat().st_mtime)
    summary = json.loads(latest.read_text())["stages"]
    for s, hashes in before.items():  # finished stages were reused, not redone
        if s in summary and summary[s]["hash"] in hashes:
            assert summary[s]["reused"], s


@pytest.mark.chaos
@pytest.mark.parametrize("spec", KILL_POINTS)
def test_sigkill_at_a_named_point_then_rerun_gives_the_same_artifacts(reference, tmp_path, spec):
    _kill_then_rerun(reference, tmp_path, spec)


@pytest.mark.chaos
@pytest.mark.parametrize("stage", SEEDED)
@pytest.mark.parametrize("seed", [1, 2])
def test_sigkill_at_a_seeded_point_then_rerun_gives_the_same_artifacts(reference, tmp_path, stage, seed):
    fraction = round(random.Random(seed).uniform(0.05, 0.95), 3)
    print(f"seed {seed}: {stage} killed at {fraction} of its records")
    _kill_then_rerun(reference, tmp_path, f"{stage}@{fraction}")


def test_every_artifact_catches_a_flipped_byte_and_a_cut_file(smoke_run, tmp_path):
    """Each artifact of the session's smoke run, copied twice.

    One file gets a flipped byte, another is cut in half.
    """
    reference = Path(smoke_run[1]["stages"]["ingest"]["artifact"]).parent.parent
    import shutil

    from moeflow.store.format import ArtifactError
    from moeflow.store.local import Manifest

    caught = 0
    for stage, arts in _artifacts(reference).items():
        for a in arts:
            folder = reference / a["stage"] / f"{a['stage']}-{a['artifact']['hash']}"
            files = sorted(p for p, meta in Manifest.read(folder).files.items() if meta["bytes"] > 1)
            for i, how in enumerate(("flip", "cut")):
                copy = tmp_path / f"{folder.name}-{how}"
                shutil.copytree(folder, copy)
                victim = copy / files[i % len(files)]
                data = bytearray(victim.read_bytes())
                if how == "flip":
                    data[len(data) // 2] ^= 0x01
                else:
                    data = data[: len(data) // 2]
                victim.write_bytes(bytes(data))
                with pytest.raises(
                    ArtifactError, match=rf"{victim.name}.*--rerun {stage.split('.')[0]}"
                ):
                    Manifest.read(copy).verify()
                caught += 1
    assert caught >= 2 * len(DETERMINISTIC)


def _unfinished(store: Path, stage: str) -> list[str]:
    """What a stage (and its parts) left in the store, locks and its plan (a part that finished) aside."""
    return [p.name for folder in store.glob(f"{stage}*") for p in folder.iterdir()
            if not p.name.endswith(".lock") and folder.name != f"{stage}.plan"]


def test_a_full_disk_fails_the_stage_clearly_and_publishes_nothing(prefect_server, smoke_data, tmp_path):
    """RLIMIT_FSIZE stands in for a full disk (no mount needed): writes past 64 KB fail with EFBIG."""
    import resource

    store = tmp_path / "store"
    config = write_config(tmp_path / "smoke.yaml", store=str(store))

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG from write() instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    proc = _start(config, "--until", "ingest", preexec_fn=limit)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0
    assert "ingest.shard: the artifact store ran out of space" in out  # its one shard writes the documents
    assert _unfinished(store, "ingest") == []  # no shard or joined artifact, no staging


def test_a_full_tmpfs_fails_the_stage_publishes_nothing_and_a_rerun_with_room_completes(smoke_run, tmp_path):
    """A real full disk: the store on a 256 KB tmpfs (mounting needs root, as in CI). After the failure the
    tmpfs is grown: the rerun reuses the stage that finished and builds the rest."""
    store = tmp_path / "store"
    store.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(store)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({mounted.stderr.strip()}); the RLIMIT_FSIZE test covers the message"
        )
    try:
        config = write_config(tmp_path / "smoke.yaml", store=str(store))
        proc = _start(config, "--until", "ingest")
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode != 0
        assert "ingest.shard: the artifact store ran out of space" in out and "No space left on device" in out
        assert _unfinished(store, "ingest") == []
        assert (
            len(list((store / "sources").glob("sources-*/manifest.json"))) == 1
        )  # the stage before was published
        subprocess.run(["mount", "-o", "remount,size=64m", str(store)], check=True)
        out = _finish(_start(config, "--until", "ingest"))
        assert any(line.split()[:2] == ["sources", "reused"] for line in out.splitlines()), out[-2000:]
        assert _content(store)["ingest"] == smoke_run[1]["stages"]["ingest"]["content_hash"]  # the session's cold run
    finally:
        subprocess.run(["umount", "-l", str(store)], capture_output=True)


class _MemoryCap:
    """A cgroup (v2, else v1) with a memory limit that a child process joins before it execs; `path` is
    None where this machine lets no cgroup be made (not root, or no memory controller)."""

    def __init__(self, limit: int):
        self.path = None
        for root, limit_file, events in (
            (Path("/sys/fs/cgroup"), "memory.max", "memory.events"),
            (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes", "memory.oom_control"),
        ):
            if not (root / "cgroup.procs").exists():  # not a cgroup filesystem (e.g. the tmpfs above v1's)
                continue
            path = root / f"moeflow-test-{os.getpid()}"
            try:
                path.mkdir(exist_ok=True)
                (path / limit_file).write_text(str(limit))  # the kernel made the file, or this fails
            except OSError:
                if path.is_dir():
                    path.rmdir()
                continue
            self.path, self.events = path, path / events
            return

    def join(self) -> None:  # in the child, before exec
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int | None:
        """The most memory the group has held (v2 `memory.peak`, v1 `memory.max_usage_in_bytes`), if known."""
        for name in ("memory.peak", "memory.max_usage_in_bytes"):
            if (self.path / name).exists():
                return int((self.path / name).read_text())
        return None

    def oom_kills(self) -> int:
        for line in self.events.read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def remove(self) -> None:
        """Once the last process in it has exited.

        A run's workers may outlive its main process by a moment.
        """
        deadline = time.monotonic() + 60
        while (self.path / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.path.rmdir()


@pytest.mark.big
def test_a_source_larger_than_memory_streams_through_every_data_stage(prefect_server, smoke_data, tmp_path):
    """2 GB of JSONL (100,000 distinct ~2 KB documents and their copies) through every data stage to `mix`,
    sharded in four, with the run's whole process tree capped at 1.5 GiB of memory (a cgroup; where none
    can be made, the largest process's peak RSS is held to the same bound)."""
    import resource

    from helpers import write_large_jsonl

    limit = 1536 << 20
    size = int(os.environ.get("MOEFLOW_BIG_SOURCE_BYTES", 2_000_000_000))
    source = tmp_path / "big.jsonl"
    unique = int(os.environ.get("MOEFLOW_BIG_SOURCE_DOCS", 100_000))
    lines = write_large_jsonl(source, size, unique=unique, words=300)
    assert source.stat().st_size > limit
    store = tmp_path / "store"
    config = write_config(
        tmp_path / "big.yaml",
        store=str(store),
        sources=[
            {
                "name": "big",
                "path": str(source),
                "format": "jsonl",
                "id_field": "id",
                "domain": "synthetic",
                "license": "cc0",
            }
        ],
        filter={"steps": ["length"], "overrides": {}},
        quality=None,  # smoke's classifier keeps by per-domain rules for domains this config has not
        mix={"weights": {"synthetic": 1.0}, "phases": []},
        execution={"shards": 4},  # two workers (the cores), each shard a quarter of the documents
    )  # dedup.partitions unset: 17 for 1.2M documents (`dedup.corpus.partitions`)
    cap = _MemoryCap(limit)
    try:
        _finish(_start(config, "--until", "mix", preexec_fn=cap.join if cap.path else None), timeout=3000)
        if cap.path:
            assert cap.oom_kills() == 0
        else:  # the largest process's peak RSS (of this test process's children so far)
            assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 < limit
    finally:
        if cap.path:
            cap.remove()
    stats = {
        st: json.loads(p.read_text())["stats"]
        for st in ("ingest", "filter", "dedup", "decontaminate", "tokenize", "mix")
        for p in (store / st).glob(f"{st}-*/lineage.json")
    }
    assert (
        stats["ingest"]["documents_in"] == stats["ingest"]["documents_out"] == lines
    )  # every line accounted for
    assert stats["filter"]["documents_in"] == lines
    assert stats["dedup"]["documents_in"] == stats["filter"]["documents_out"]
    assert stats["dedup"]["documents_out"] == unique
    assert stats["dedup"]["fates"]["duplicate"] == lines - unique
    assert stats["decontaminate"]["documents_in"] == unique
    assert stats["tokenize"]["documents_out"] == stats["decontaminate"]["documents_out"]
    assert stats["mix"]["train_tokens"] > 0
    assert stats["dedup"]["partitions"] == -(-lines * 14 // 1_000_000)


@pytest.mark.big
def test_a_20_gb_decompression_bomb_is_quarantined_at_flat_memory(prefect_server, smoke_data, tmp_path):
    """`moeflow run --until ingest` over a source holding a 640 KB zstd file that expands to 20 GB, under
    `make big`'s memory cap: the bomb is quarantined `decompression_bomb`, the source's other file is kept.
    Peak memory (the cgroup's, where one can be made) does not grow with what a bomb expands to: a bomb of zeros
    is one long line, held, as any line is, up to the line limit (6 x max_doc_bytes + 1 MiB), so a 1 GB and a
    20 GB bomb each stay within that limit and 32 MiB (a decompressed chunk, noise) of the run without one.
    """
    import resource

    from helpers import bomb
    from moeflow.configs import SourceConfig
    from moeflow.core.ledger import read as read_ledger
    from moeflow.ingest.jsonl import _line_limit

    limit, peaks = 1536 << 20, {}
    for case, size in (("without", 0), ("1 GB", 1 << 30), ("20 GB", 20 << 30)):
        folder = tmp_path / case / "in"
        folder.mkdir(parents=True)
        (folder / "good.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n"
                                                   for i in range(200)))
        if size:
            assert bomb(folder / "bomb.jsonl.zst", size).stat().st_size < 1 << 20
        store = tmp_path / case / "store"
        source = {"name": "s", "path": str(folder / "*"), "format": "jsonl", "domain": "synthetic", "license": "cc0"}
        config = write_config(tmp_path / case / "bomb.yaml", store=str(store), sources=[source],
                              filter={"steps": ["length"], "overrides": {}}, quality=None,
                              mix={"weights": {"synthetic": 1.0}, "phases": []})
        cap = _MemoryCap(limit)
        try:
            _finish(_start(config, "--until", "ingest", preexec_fn=cap.join if cap.path else None), timeout=600)
            if cap.path:
                assert cap.oom_kills() == 0
                peaks[case] = cap.peak()
        finally:
            if cap.path:
                cap.remove()
        if not cap.path:
            assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 < limit
        (ingest,) = _artifacts(store)["ingest"]
        ledger = read_ledger(next(store.glob("ingest/ingest-*"))).to_pylist()
        bombs = {r["doc_id"] for r in ledger if r["reason"] == "decompression_bomb"}
        assert bombs == ({"s/bomb.jsonl.zst#L1", "s/bomb.jsonl.zst#rest"} if size else set())
        assert ingest["stats"]["documents_out"] == 200
    print("cgroup peaks:", peaks)
    if peaks and None not in peaks.values():
        line = _line_limit(SourceConfig(**source))
        assert max(peaks["1 GB"], peaks["20 GB"]) - peaks["without"] < line + (32 << 20), peaks
