"""The training device: resolved from `train.device`, stated in the card, and nothing pinned to the CPU."""

import re
from pathlib import Path

import pytest
import torch

from moeflow.moe import device

ROOT = Path(__file__).resolve().parent.parent


def test_auto_is_cuda_when_present_else_cpu():
    assert device.resolve("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert device.resolve("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_asking_for_cuda_without_it_names_the_setting_and_the_fix():
    with pytest.raises(device.DeviceError, match=r"train.device is 'cuda' .* set train.device: auto or cpu"):
        device.resolve("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_evaluation_computes_where_training_does(tmp_path):
    from types import SimpleNamespace

    from moeflow import configs
    from moeflow.moe import evaluate
    from moeflow.tasks.registry import STAGES

    cfg = configs.load("smoke")
    cuda = cfg.model_copy(update={"train": cfg.train.model_copy(update={"device": "cuda"})})
    slice_ = STAGES["evaluate"].config(cuda)
    assert slice_.device == "cuda"
    inputs = {"model": SimpleNamespace(dir=tmp_path), "mix": SimpleNamespace(dir=tmp_path)}
    with pytest.raises(device.DeviceError):  # not quietly the CPU
        evaluate.stage(slice_, inputs, tmp_path)
    back = cuda.model_copy(update={"evaluate": cuda.evaluate.model_copy(update={"device": "cpu"})})
    assert STAGES["evaluate"].config(back).device == "cpu"
    # what shapes its output: the tokenizer encodes the benchmark requests, pyarrow reads the rows
    assert {"tokenizers", "pyarrow", "torch"} <= set(STAGES["evaluate"].libraries)


def test_the_cpu_is_described_and_has_no_known_peak():
    cpu = device.describe(torch.device("cpu"))
    assert cpu["type"] == "cpu" and cpu["count"] >= 1
    assert device.peak_tflops(torch.device("cpu"), "bf16") is None
    rows = torch.arange(6).reshape(2, 3).numpy()
    assert device.batch(rows, torch.device("cpu")).tolist() == [[0, 1, 2], [3, 4, 5]]


def test_no_training_evaluation_or_ladder_code_pins_the_cpu():
    pinned = re.compile(r"""["']cpu["']|\.cpu\(\)|device=None""")
    for name in ("train.py", "evaluate.py", "ladder.py", "parallel.py", "layer.py", "experts.py", "model.py"):
        lines = (ROOT / "moe" / name).read_text().splitlines()
        assert [f"{name}:{i}: {x}" for i, x in enumerate(lines, 1) if pinned.search(x)] == []


def _gpu_check(*args: str) -> dict:
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "moeflow.moe.gpu_check", "--bundle", "/nonexistent", *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU answer")
def test_gpu_check_says_plainly_that_there_is_no_gpu():
    out = _gpu_check()
    assert out["ran"] is False and "no CUDA device" in out["reason"]
    assert out["tiers"]["cuda"]["cuda"] is False and list(out["tiers"]) == ["cuda"]


def test_gpu_check_runs_its_own_code_on_the_cpu_at_toy_sizes():
    out = _gpu_check("--device", "cpu", "--small")
    tiers = out["tiers"]
    assert out["ran"] and tiers["cuda"]["device"]["type"] == "cpu"
    assert tiers["bf16"]["ok"], tiers["bf16"]
    trained, scaling = tiers["throughput"]["train"], tiers["throughput"]["moe_scaling"]
    assert trained["tokens_per_s"] > 0 and trained["mfu"] is None
    assert scaling["device"] == "cpu" and scaling["t1024_e64_vs_e8"] > 0
    # both report the dtype the experts' matmuls ran in: bf16, as training under `precision: bf16` runs them
    assert trained["expert_matmul_dtype"] == scaling["expert_matmul_dtype"] == "bfloat16"
    assert tiers["nccl"] == {**tiers["nccl"], "ok": True, "backend": "gloo", "sums": [3.0, 3.0]}
    # no bundle here: the summary says so, and the megablocks tier, which builds from it, fails naming it
    assert "make gpu-bundle" in out["bundle"]["error"] and "make gpu-bundle" in str(tiers["megablocks"])
    assert out["ok"] is False


def test_training_outside_a_flow_needs_no_orchestrator():
    """`make gpu-check` trains on a machine without Prefect: the training path must not import it."""
    import subprocess
    import sys

    code = ("import sys, moeflow.moe.gpu_check, moeflow.moe.train\n"
            "print(sorted(m for m in sys.modules if 'prefect' in m))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
