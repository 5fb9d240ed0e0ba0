"""`make gpu-check`: the prepared GPU verification; one JSON line last, and a plain no-op without CUDA.

On a CUDA machine it (1) installs MegaBlocks and grouped_gemm against the torch already there, (2) trains
the torch backend on the GPU in bf16 for 20 steps and compares the loss curve with the CPU's float32
curve, (3) compares MegaBlocks' real kernels with the torch backend on the GPU, (4) trains a model that
fills the GPU for 200 steps and reports tokens/s, MFU and the dtype its experts' matmuls ran in, and (5) runs
the expert-count scaling benchmark (`benchmarks/moe_scaling.py --device cuda --precision bf16`: 8 to 64
experts at fixed active parameters; it reports the experts' matmul dtype too).
Each part records its own error in the JSON and the others still run. `--device cpu --small` runs the
same code on the CPU, at toy sizes, to check the script itself where no GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from moeflow.moe import device as devices
from moeflow.moe.gpu_tiers import _data, bf16_against_cpu, megablocks_against_torch, scaling_benchmark, throughput

ROOT = Path(__file__).resolve().parent.parent
MEGABLOCKS = ["megablocks==0.10.0", "stanford-stk==0.7.1", "grouped_gemm==0.3.0"]


def install() -> dict:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", *MEGABLOCKS]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return {"ok": proc.returncode == 0, "seconds": round(time.perf_counter() - t0, 1),
            "error": proc.stderr[-1500:] if proc.returncode else None}


def _part(name: str, fn, results: dict) -> None:
    try:
        results[name] = fn()
    except Exception as e:  # one part failing must not hide the others' figures
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                         "trace": traceback.format_exc()[-1500:]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: check this script itself")
    p.add_argument("--small", action="store_true", help="toy sizes (with --device cpu)")
    args = p.parse_args(argv)
    results: dict = {"cuda": torch.cuda.is_available(), "torch": torch.__version__}
    if args.device == "cuda" and not torch.cuda.is_available():
        results["ran"] = False
        results["reason"] = "torch sees no CUDA device on this machine: nothing to check"
        print(json.dumps(results))
        return 0
    dev = devices.resolve(args.device)
    results["device"] = devices.describe(dev)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = _data(root / "data")
        if dev.type == "cuda":
            _part("install_megablocks", install, results)
            _part("megablocks_vs_torch", lambda: megablocks_against_torch(dev), results)
        _part("bf16_vs_cpu_fp32", lambda: bf16_against_cpu(data, root, args.device), results)
        (root / "big").mkdir()
        _part("throughput", lambda: throughput(root / "big", args.device, args.small), results)
        _part("moe_scaling", lambda: scaling_benchmark(args.device, args.small), results)
    results["ran"] = True
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
