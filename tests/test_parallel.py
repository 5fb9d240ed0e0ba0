"""Training under torchrun (gloo, CPU).

2 ranks with experts split across them reproduce the single process; the launcher stops torchrun when the
build's lease is lost, and reads its output while it uploads a checkpoint.
"""

import json
import os
import shutil
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers import write_config, write_training_mix
from moeflow import configs
from moeflow.configs import ModelConfig, TrainConfig
from moeflow.moe import launch, train

MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=2, num_experts=4, top_k=2, expert_hidden=32)
BASE = {"steps": 12, "batch_size": 8, "seq_len": 32, "lr": 1e-2, "warmup_steps": 2, "checkpoint_every": 4}
# Stated tolerance: float32 sums in another order (the experts see the same rows, the all-reduce adds
# two halves) may differ in the last bits; 12 steps of AdamW keep that far below 1e-4.
TOL = 1e-4


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_training_mix(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def single(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    return out, train.run(MODEL, TrainConfig(**BASE), seed=7, mix_dir=data, tokenizer_dir=data, out=out)


def _torchrun(data, out: Path, model: ModelConfig = MODEL, **distributed) -> dict:
    cfg = TrainConfig(**BASE, distributed={"nproc_per_node": 2, **distributed})
    return launch.torchrun(model, cfg, seed=7, mix_dir=data, tokenizer_dir=data, out=out, work=out / "work")


def _records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _assert_same_run(a: Path, b: Path) -> None:
    ra, rb = _records(a), _records(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(1, BASE["steps"] + 1))
    for x, y in zip(ra, rb):
        for key in ("loss", "ce", "load_balancing_loss", "router_z_loss"):
            assert abs(x[key] - y[key]) <= TOL, (x["step"], key, x[key], y[key])
        assert abs(x["grad_norm"] - y["grad_norm"]) <= TOL * max(1.0, x["grad_norm"]), (
            x["step"],
            x["grad_norm"],
            y["grad_norm"],
        )
        assert x["tokens_per_expert"] == y["tokens_per_expert"]  # routing decisions are identical
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()  # the checkpoint holds the whole model, experts gathered from both ranks
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=TOL, rtol=TOL, msg=k)


def test_two_ranks_with_expert_parallelism_give_the_single_process_run(data, single, tmp_path):
    one, summary_one = single
    summary = _torchrun(data, tmp_path)
    _assert_same_run(one, tmp_path)
    assert summary["params_total"] == summary_one["params_total"]  # counted over both ranks' experts
    d = summary["distributed"]
    assert d["world_size"] == 2 and d["expert_parallel"]
    records = _records(tmp_path)
    assert [rank["rank"] for rank in d["ranks"]] == [0, 1]
    assert all([s["rank"] for s in r["ranks"]] == [0, 1] for r in records)  # every step records both ranks
    # each rank's experts processed exactly the assignments routed to them: ranks 0/1 hold experts 0-1/2-3,
    # step by step and over the run
    routed = np.sum([r["tokens_per_expert"] for r in records], axis=0)  # [layer, expert]
    for rank in d["ranks"]:
        i = rank["rank"]
        steps = [r["ranks"][i] for r in records]
        for r, s in zip(records, steps):
            assert s["expert_tokens"] == [layer[2 * i : 2 * i + 2] for layer in r["tokens_per_expert"]], (
                r["step"],
                i,
            )
        assert np.array_equal(np.array(rank["expert_tokens"]), routed[:, 2 * i : 2 * i + 2])
        # the token all-to-alls run inside the step (forward and backward of both MoE layers)
        assert all(0 < s["all_to_all_s"] <= s["step_s"] for s in steps), steps
        # the share is the run's recorded all-to-all seconds over its recorded step seconds
        a2a_s, step_s = sum(s["all_to_all_s"] for s in steps), sum(s["step_s"] for s in steps)
        assert rank["all_to_all_share"] == pytest.approx(
            a2a_s / step_s, abs=1e-4
        )  # the summary rounds to 4 places
        assert rank["step_s"] == pytest.approx(step_s, abs=0.01)
    # rank 0's recorded step time is the one its step's throughput was measured over
    for r in records:
        tokens = BASE["batch_size"] * r["seq_len"]
        assert r["ranks"][0]["step_s"] * r["tokens_per_s"] == pytest.approx(tokens, rel=1e-2), r["step"]
    # together the ranks' experts processed the single process's assignments: every token's top_k, per layer
    routed_one = np.sum([r["tokens_per_expert"] for r in _records(one)], axis=0)
    assert np.array_equal(np.concatenate([rank["expert_tokens"] for rank in d["ranks"]], axis=1), routed_one)
    assert (
        routed_one.sum(axis=1).tolist()
        == [BASE["steps"] * BASE["batch_size"] * BASE["seq_len"] * MODEL.top_k] * MODEL.n_layers
    )


def test_data_parallel_with_replicated_experts_gives_the_single_process_run(data, single, tmp_path):
    _torchrun(data, tmp_path, expert_parallel=False)
    _assert_same_run(single[0], tmp_path)


@pytest.mark.check
def test_the_expert_bias_moves_alike_on_two_ranks_and_in_one_process(data, tmp_path):
    """`router_bias_rate`: each rank moves its copy of the bias by every rank's load, so the ranks route alike and
    the run is the single process's, biases included."""
    model = MODEL.model_copy(update={"router_bias_rate": 1e-2})
    train.run(model, TrainConfig(**BASE), seed=7, mix_dir=data, tokenizer_dir=data, out=tmp_path / "one")
    _torchrun(data, tmp_path / "two", model)
    _assert_same_run(tmp_path / "one", tmp_path / "two")
    assert load_file(str(tmp_path / "two" / "model.safetensors"))["blocks.0.moe.router.expert_bias"].any()


@pytest.mark.check
def test_two_nodes_started_as_the_readme_says_give_the_single_process_run(data, single, tmp_path):
    """nnodes 2 on one machine: node 0 is the train stage's launch; node 1 runs the command it logs, with
    --node-rank=1 (the spec it names is in the shared work folder)."""
    import subprocess
    import threading

    cfg = TrainConfig(
        **BASE,
        distributed={"nproc_per_node": 1, "nnodes": 2, "rdzv_endpoint": f"127.0.0.1:{launch.free_port()}"},
    )
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    result: dict = {}

    def node0() -> None:
        try:
            result["summary"] = launch.torchrun(
                MODEL, cfg, seed=7, mix_dir=data, tokenizer_dir=data, out=out, work=work
            )
        except Exception as e:  # noqa: BLE001 - reported below
            result["error"] = e

    thread = threading.Thread(target=node0)
    thread.start()
    spec = work / launch.SPEC
    for _ in range(600):
        if spec.exists() or not thread.is_alive():
            break
        time.sleep(0.1)
    cmd = [a.replace("--node-rank=0", "--node-rank=1") for a in launch.command(cfg, spec)]
    node1 = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    thread.join(timeout=600)
    assert "error" not in result, result.get("error")
    assert node1.returncode == 0, node1.stdout[-2000:] + node1.stderr[-2000:]
    _assert_same_run(single[0], out)
    d = result["summary"]["distributed"]
    assert d["world_size"] == 2 and d["nnodes"] == 2


@pytest.mark.check
def test_an_interrupted_torchrun_resumes_from_its_last_checkpoint(data, tmp_path):
    first = _torchrun(data, tmp_path / "a")
    work = tmp_path / "a" / "work"
    shutil.rmtree(work / "checkpoints" / "step-0000012")  # as if killed after step 8's checkpoint
    out = tmp_path / "b"
    out.mkdir()
    summary = launch.torchrun(
        MODEL,
        TrainConfig(**BASE, distributed={"nproc_per_node": 2}),
        seed=7,
        mix_dir=data,
        tokenizer_dir=data,
        out=out,
        work=work,
    )
    assert summary["resumed_from_step"] == 8 and first["resumed_from_step"] is None
    ra, rb = _records(tmp_path / "a"), _records(out)
    assert [(r["ce"], r["grad_norm"]) for r in ra] == [(r["ce"], r["grad_norm"]) for r in rb]


def test_a_failing_rank_fails_the_launch_with_its_output(data, tmp_path):
    cfg = TrainConfig(
        **{**BASE, "steps": 1000}, distributed={"nproc_per_node": 2}
    )  # 1000 x 8 rows > 96 in the mix
    with pytest.raises(
        RuntimeError, match="torchrun exited with status 1: ValueError: train: the mix holds 96 sequences"
    ):
        launch.torchrun(
            MODEL, cfg, seed=7, mix_dir=data, tokenizer_dir=data, out=tmp_path, work=tmp_path / "work"
        )


def test_configs_refuse_what_cannot_be_split(tmp_path):
    with pytest.raises(ValueError, match="must split evenly over the 2 ranks"):
        TrainConfig(batch_size=6, grad_accum=2, distributed={"nproc_per_node": 2})
    with pytest.raises(ValueError, match="rdzv_endpoint needs a fixed host:port"):
        TrainConfig(distributed={"nnodes": 2})
    with pytest.raises(ValueError, match="num_experts=6 cannot be split over the 4 ranks"):
        configs.load(
            write_config(
                tmp_path / "c.yaml", model={"num_experts": 6}, train={"distributed": {"nproc_per_node": 4}}
            )
        )
    with pytest.raises(ValueError, match="set model.backend: torch"):
        configs.load(
            write_config(
                tmp_path / "c.yaml",
                model={"backend": "megablocks"},
                train={"distributed": {"nproc_per_node": 2}},
            )
        )


def _torchrun_running(folder: Path, script: str) -> list[str]:
    """The launcher's torchrun command (2 ranks), each rank running `script` instead of training."""
    (folder / "rank.py").write_text(script)
    return [*launch.command(TrainConfig(distributed={"nproc_per_node": 2}), "-")[:-3], str(folder / "rank.py")]


def _torchrun_processes() -> list[int]:
    """This test's torchrun and its ranks (their command lines name torch.distributed.run, rank.py)."""
    from moeflow.cli.stack import descendants

    def cmdline(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""  # gone

    return [p for p in descendants(os.getpid()) if b"rank.py" in cmdline(p) or b"torch.distributed.run" in cmdline(p)]


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


QUIET = """
import time
print("step 1", flush=True)
time.sleep(30)  # a long stretch without output (logging every N steps; an evaluation)
"""


@pytest.mark.check  # a launch or several processes against the S3 server: the slower tier
def test_a_lost_lease_stops_torchrun_within_seconds(tmp_path):
    """The build's lease taken by another writer while torchrun trains without printing: LeaseLost stops torchrun
    and its ranks within seconds, instead of waiting in the launcher's output loop for their next line."""
    import fsspec

    from moeflow.store.lease import Lease, LeaseLost

    cmd = _torchrun_running(tmp_path, QUIET)
    fs, prefix = fsspec.filesystem("memory"), f"leases/{uuid.uuid4().hex}"
    seen: dict = {}

    def take_the_lease(lease: Lease) -> None:
        """Once both ranks run, another writer takes the lease (as after this one paused past its expiry); 8 s
        later, what still runs of torchrun's processes."""
        deadline = time.monotonic() + 60
        while len(found := _torchrun_processes()) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        fs.pipe_file(f"{prefix}/{lease.gen + 1:012d}", b"{}")
        seen["taken"] = time.monotonic()
        time.sleep(8)
        seen["left"] = [p for p in found if _running(p)]

    with pytest.raises(LeaseLost, match="another writer took it"):
        with Lease(fs, prefix, seconds=3) as lease:  # renewed every second: the loss is seen within one
            taker = threading.Thread(target=take_the_lease, args=(lease,))
            taker.start()
            launch._stream(cmd, TrainConfig(distributed={"nproc_per_node": 2}), None, tmp_path)
    took = time.monotonic() - seen["taken"]
    print(f"LeaseLost {took:.1f} s after another writer took the lease")
    taker.join()
    assert seen["left"] == [], f"torchrun or its ranks still ran 8 s after the loss (LeaseLost after {took:.1f} s)"
    assert took < 8


WRITE_1MB = """
import os, time
t = time.monotonic()
for _ in range(10_000):
    print("x" * 99)
open(os.environ["DONE"] + os.environ["RANK"], "w").write(str(time.monotonic() - t))
"""


@pytest.mark.check  # a launch or several processes against the S3 server: the slower tier
def test_a_slow_checkpoint_upload_does_not_stall_torchruns_output(tmp_path, monkeypatch):
    """Sharing a checkpoint with the object store takes 3 s and is due every 0.5 s: torchrun's ranks still
    write 1 MB of output each (16 pipe buffers) at once, their output read on while the upload runs."""
    monkeypatch.setattr(launch, "SHARE_EVERY_S", 0.5)
    monkeypatch.setattr(launch, "share_checkpoint", lambda shared, work: time.sleep(3))
    monkeypatch.setenv("DONE", str(tmp_path / "wrote"))
    cmd = _torchrun_running(tmp_path, WRITE_1MB)
    returncode, tail = launch._stream(cmd, TrainConfig(distributed={"nproc_per_node": 2}), object(), tmp_path)
    assert returncode == 0, "".join(tail)
    wrote = [float((tmp_path / f"wrote{rank}").read_text()) for rank in (0, 1)]
    assert max(wrote) < 2, f"the ranks took {wrote} s to write their output"
