"""Training under torchrun (gloo, CPU).

2 ranks with experts split across them reproduce the single process.
"""

import json
import shutil
import time
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


def _torchrun(data, out: Path, **distributed) -> dict:
    cfg = TrainConfig(**BASE, distributed={"nproc_per_node": 2, **distributed})
    return launch.torchrun(MODEL, cfg, seed=7, mix_dir=data, tokenizer_dir=data, out=out, work=out / "work")


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
