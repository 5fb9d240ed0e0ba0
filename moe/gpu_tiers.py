"""The parts of `make gpu-check` (moe/gpu_check.py) that train and time models: each a function returning
its figures as a dict.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from tokenizers.implementations import ByteLevelBPETokenizer

from moeflow.configs import ModelConfig, TrainConfig
from moeflow.moe import device as devices
from moeflow.moe import train
from moeflow.moe.backend import build_moe
from moeflow.moe.experts import matmul_dtypes
from moeflow.tokenize import mix

ROOT = Path(__file__).resolve().parent.parent


def _data(folder: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import write_training_mix  # here: tests/ joins the path only above; a small learnable mix

    folder.mkdir(parents=True, exist_ok=True)
    return write_training_mix(folder)


def _curve(model: ModelConfig, data: Path, out: Path, dev: str, precision: str, steps: int) -> list[float]:
    cfg = TrainConfig(steps=steps, batch_size=4, seq_len=32, lr=1e-2, warmup_steps=2, device=dev,
                      precision=precision, checkpoint_every=steps)
    train.run(model, cfg, seed=7, mix_dir=data, tokenizer_dir=data, out=out)
    return [json.loads(line)["ce"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def bf16_against_cpu(data: Path, tmp: Path, dev: str) -> dict:
    model = ModelConfig(d_model=32, n_layers=2, n_heads=2, num_experts=4, top_k=2, expert_hidden=32)
    cpu = _curve(model, data, tmp / "cpu", "cpu", "fp32", 20)
    gpu = _curve(model, data, tmp / "gpu", dev, "bf16", 20)
    diff = float(np.max(np.abs(np.array(cpu) - np.array(gpu))))
    return {"max_abs_loss_diff": round(diff, 5), "tolerance": 0.05, "ok": diff <= 0.05,
            "final": [round(cpu[-1], 4), round(gpu[-1], 4)]}


def megablocks_against_torch(dev: torch.device) -> dict:
    cfg = ModelConfig(d_model=256, num_experts=8, top_k=2, expert_hidden=512)
    ref = build_moe(cfg).to(dev)
    mb = build_moe(cfg.model_copy(update={"backend": "megablocks"})).to(dev)
    mb.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(4096, cfg.d_model, device=dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        a, b = ref(x)[0].float(), mb(x)[0].float()
    diff = float((a - b).abs().max())
    return {"max_abs_output_diff": round(diff, 5), "tolerance": 0.05, "ok": diff <= 0.05}


def throughput(data_dir: Path, dev: str, small: bool) -> dict:
    """A model that fills the GPU (at --small, a toy), 200 steps of bf16: tokens/s and MFU."""
    sizes = (64, 2, 8, 64, 8, 10) if small else (2048, 12, 32, 2048, 16, 200)
    width, layers, experts, seq, batch, steps = sizes
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(["abc def ghi " * 50], vocab_size=300, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    tok.save(str(data_dir / "tokenizer.json"))
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, tok.get_vocab_size(), seq + 1) for _ in range(batch * steps)]
    mix.write_rows(data_dir / "train.arrow", rows, [[] for _ in rows], tok.get_vocab_size())
    model = ModelConfig(d_model=width, n_layers=layers, n_heads=max(2, width // 128), num_experts=experts,
                        top_k=2, expert_hidden=width // 2)
    cfg = TrainConfig(steps=steps, batch_size=batch, seq_len=seq, lr=1e-4, warmup_steps=2, device=dev,
                      precision="bf16", checkpoint_every=steps, log_every=10)
    dtype = _expert_dtype(train.build_model(model, tok.get_vocab_size(), seq, 0), np.stack(rows[:batch]), dev)
    summary = train.run(model, cfg, seed=0, mix_dir=data_dir, tokenizer_dir=data_dir, out=data_dir / "out")
    return {"params_active": summary["params_active"], "tokens_per_s": summary["tokens_per_s"],
            "mfu": summary.get("mfu"), "device": summary["device"], "expert_matmul_dtype": dtype}


def _expert_dtype(model: torch.nn.Module, rows: np.ndarray, dev: str) -> str:
    """The dtype the experts' matmuls run in when training computes a batch in bf16 (one forward)."""
    where = devices.resolve(dev)
    model.to(where)
    with matmul_dtypes(model) as seen, torch.no_grad(), torch.autocast(where.type, dtype=torch.bfloat16):
        model(devices.batch(np.ascontiguousarray(rows[:, :-1]), where))
    return ",".join(sorted(seen))


def scaling_benchmark(dev: str, small: bool) -> dict:
    sizes = ["1024", "--repeats", "1"] if small else ["16384", "65536", "--repeats", "3"]
    bench = ROOT / "benchmarks" / "moe_scaling.py"
    cmd = [sys.executable, str(bench), "--device", dev, "--precision", "bf16", "--tokens", *sizes]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-1500:])
    return json.loads(proc.stdout.splitlines()[-1])
