"""The tiers of `make gpu-check` (moe/gpu_check.py), each run as its own process: `python -m
moeflow.moe.gpu_tiers TIER --device D [--small]` prints that tier's figures as one JSON line.

cuda: what torch sees. bf16: the torch backend trained 20 steps in bf16 against the CPU's fp32 curve.
throughput: a model that fills the GPU (d_model 2048, 12 layers, 32 experts) and the expert-count scaling
benchmark. megablocks: MegaBlocks and grouped_gemm built from the bundle's sources, parity with the torch
backend and both layers' speed. nccl: a two-rank all-reduce (gloo on the CPU), or why it cannot run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from tokenizers.implementations import ByteLevelBPETokenizer

from moeflow.configs import ModelConfig, TrainConfig
from moeflow.moe import device as devices
from moeflow.moe import train
from moeflow.moe.backend import build_moe
from moeflow.moe.experts import matmul_dtypes
from moeflow.moe.metrics import summarise
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


def megablocks_against_torch(dev: torch.device, small: bool) -> dict:
    """The same weights in both backends: their outputs in bf16, then each layer's forward+backward speed."""
    cfg = ModelConfig(d_model=256, num_experts=8, top_k=2, expert_hidden=512)
    ref = build_moe(cfg).to(dev)
    mb = build_moe(cfg.model_copy(update={"backend": "megablocks"})).to(dev)
    mb.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(4096, cfg.d_model, device=dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        a, b = ref(x)[0].float(), mb(x)[0].float()
    diff = float((a - b).abs().max())
    big = cfg if small else ModelConfig(d_model=2048, num_experts=32, top_k=2, expert_hidden=1024)
    speed = {name: _layer_speed(big.model_copy(update={"backend": name}), dev, 1024 if small else 16384)
             for name in ("torch", "megablocks")}
    return {"max_abs_output_diff": round(diff, 5), "tolerance": 0.05, "ok": diff <= 0.05,
            "tokens_per_s": speed, "megablocks_vs_torch": round(speed["megablocks"] / speed["torch"], 3)}


def _layer_speed(cfg: ModelConfig, dev: torch.device, tokens: int, repeats: int = 5) -> float:
    """Tokens/s of one MoE layer's forward and backward in bf16: the best of `repeats` after two warm-ups."""
    layer = build_moe(cfg).to(dev)
    x = torch.randn(tokens, cfg.d_model, device=dev, requires_grad=True)
    times = []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            y = layer(x)[0]
        y.float().square().mean().backward()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return round(tokens / min(times), 1)


def train_throughput(data_dir: Path, dev: str, small: bool) -> dict:
    """A model that fills the GPU (at --small, a toy), 40 steps of bf16: tokens/s and MFU."""
    sizes = (64, 2, 8, 64, 8, 10) if small else (2048, 12, 32, 2048, 8, 40)
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
    probe = model.model_copy(update={"d_model": 64, "n_layers": 1, "n_heads": 2, "expert_hidden": 32})
    dtype = _expert_dtype(train.build_model(probe, tok.get_vocab_size(), seq, 0), np.stack(rows[:2]), dev)
    summary = _Uncheckpointed(model, cfg, seed=0, mix_dir=data_dir, tokenizer_dir=data_dir, out=data_dir / "out",
                              work=None, ladder_dir=None, band_tolerance=0.05).fit()
    return {"params_active": summary["params_active"], "tokens_per_s": summary["tokens_per_s"],
            "mfu": summary.get("mfu"), "device": summary["device"], "expert_matmul_dtype": dtype}


class _Uncheckpointed(train.Trainer):
    """Training that writes no checkpoint: the full-size model's (2.4B parameters and AdamW's state) would be
    about 29 GB of the GPU machine's 64 GB disk and minutes of its time."""

    def checkpoint_if_due(self, step: int) -> None:
        pass

    def finish(self) -> dict:
        self.runlog.close()
        records = [json.loads(line) for line in (self.work / "metrics.jsonl").read_text().splitlines()]
        summary = summarise(records, self.model, self.model_cfg, self.cfg, vocab=self.vocab, max_len=self.max_len,
                            resumes=[], resumed_from=None, alarms=self.runlog.alarms)
        return {**summary, "device": devices.describe(self.dev)}


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
    proc = subprocess.run(cmd, capture_output=True, text=True)  # the tier's time box bounds it
    if proc.returncode:
        raise RuntimeError(proc.stderr[-1500:])
    return json.loads(proc.stdout.splitlines()[-1])


def tier_cuda(dev: str, small: bool, tmp: Path) -> dict:
    """What torch sees: CUDA, the device and its count, torch's and CUDA's versions."""
    seen = {"cuda": torch.cuda.is_available(), "torch": torch.__version__, "cuda_version": torch.version.cuda,
            "device_count": torch.cuda.device_count()}
    if dev == "cuda" and not seen["cuda"]:
        return {**seen, "ok": False, "error": "torch sees no CUDA device on this machine"}
    where = devices.resolve(dev)
    if where.type == "cuda":
        seen["capability"] = ".".join(map(str, torch.cuda.get_device_capability(where)))
    return {**seen, "ok": True, "device": devices.describe(where)}


def tier_bf16(dev: str, small: bool, tmp: Path) -> dict:
    return bf16_against_cpu(_data(tmp / "data"), tmp, dev)


def tier_throughput(dev: str, small: bool, tmp: Path) -> dict:
    (tmp / "big").mkdir()
    trained = train_throughput(tmp / "big", dev, small)
    scaling = scaling_benchmark(dev, small)
    return {"ok": trained["tokens_per_s"] > 0, "train": trained, "moe_scaling": scaling}


def tier_megablocks(dev: str, small: bool, tmp: Path) -> dict:
    """Build MegaBlocks, stk and grouped_gemm from the bundle's sources into the check's site folder (on the
    CPU only the two that build there), then on CUDA compare MegaBlocks' dMoE with the torch backend."""
    where = devices.resolve(dev)
    names = ["stanford_stk", "megablocks"] + (["grouped_gemm"] if where.type == "cuda" else [])
    built = {name: _build(name, where) for name in names}
    out = {"built": built, "ok": all(b["ok"] for b in built.values())}
    if where.type != "cuda":
        return {**out, "kernels": "not run: MegaBlocks' kernels and grouped_gemm need CUDA"}
    if not out["ok"]:
        return out
    importlib.invalidate_caches()
    compared = megablocks_against_torch(where, small)
    return {**out, **compared, "ok": compared["ok"]}


def _build(name: str, where: torch.device) -> dict:
    """`pip install` one source archive from the bundle, offline, against the torch already here."""
    bundle, site = Path(os.environ["MOEFLOW_GPU_BUNDLE"]), os.environ["MOEFLOW_GPU_SITE"]
    archives = sorted((bundle / "src").glob(f"{name}-*.tar.gz"))
    if not archives:
        return {"ok": False, "error": f"no {name} source in {bundle / 'src'}: rerun `make gpu-bundle`"}
    env = dict(os.environ, MAX_JOBS=str(os.cpu_count() or 4))
    if where.type == "cuda":  # compile for this GPU only
        env["TORCH_CUDA_ARCH_LIST"] = ".".join(map(str, torch.cuda.get_device_capability(where)))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation",
           "--upgrade", "--target", site, str(archives[-1])]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    return {"ok": proc.returncode == 0, "seconds": round(time.perf_counter() - t0, 1),
            **({"error": proc.stderr[-1500:]} if proc.returncode else {})}


def tier_nccl(dev: str, small: bool, tmp: Path) -> dict:
    """A two-rank all-reduce: NCCL across two GPUs, gloo on the CPU; one GPU cannot hold two NCCL ranks."""
    backend = "nccl" if dev == "cuda" else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < 2:
        return {"ok": None, "ran": False, "backend": "nccl",
                "reason": f"two-rank NCCL needs two GPUs; this machine has {torch.cuda.device_count()}"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch_mp.spawn(_all_reduce, args=(backend, port, str(tmp)), nprocs=2, join=True)
    sums = sorted(float((tmp / f"rank{r}").read_text()) for r in range(2))
    return {"ok": sums == [3.0, 3.0], "ran": True, "backend": backend, "sums": sums}


def _all_reduce(rank: int, backend: str, port: int, tmp: str) -> None:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    where = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    x = torch.tensor([rank + 1.0], device=where)
    dist.all_reduce(x)
    Path(tmp, f"rank{rank}").write_text(str(float(x.item())))
    dist.destroy_process_group()


TIERS = {"cuda": tier_cuda, "bf16": tier_bf16, "throughput": tier_throughput, "megablocks": tier_megablocks,
         "nccl": tier_nccl}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tier", choices=list(TIERS))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true", help="toy sizes")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(TIERS[args.tier](args.device, args.small, Path(tmp))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
