"""MoE layer throughput: expert-count scaling at fixed active parameters; dense MLP and per-token baselines.

Run: `python benchmarks/moe_scaling.py [--tokens N ...] [--repeats R] [--device cpu|cuda] [--precision
fp32|bf16] [--threads N]` (default 4096 and 16384 tokens, on the CPU, fp32, all cores; `make gpu-check` runs
it with `--device cuda --precision bf16`; `--threads 1` on a shared machine, where other processes make
multi-threaded CPU timings erratic). Forward + backward tokens/s of the reference dropless layer (H=256,
F=512, top-2, SwiGLU; bf16: under autocast, as training runs it) for 8, 16, 32 and 64 experts; the same layer
against a dense SwiGLU MLP of equal active width (2 x 512) done in bare PyTorch; and against a per-token
Python loop over the same weights (a sanity floor). The layers take turns pass by pass (two warm-up rounds,
then `repeats` timed ones), each pass from cleared gradients as in a training step; each figure is the
fastest of its timed passes (the least disturbed one). `*_page_faults_per_pass` counts the process's minor
page faults per timed pass (by default glibc gives every freed block of 32 MiB or more back to the system, so
a tensor that large is faulted in afresh, zeroed page by page, each time it is made again: at 64 experts
each weight gradient is 32 MiB; the CPU experts have glibc keep freed memory,
`moe.experts.keep_freed_memory`). The last line printed is one JSON object; `*_ratio` figures compare with
the bare-PyTorch dense MLP; `expert_matmul_dtype` is the dtype the experts' matmuls ran in, read in an
untimed forward pass of each layer (bf16 must show bfloat16: autocast has no grouped-matmul kernel, the
experts cast themselves).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from contextlib import nullcontext

import torch

from moeflow.configs import ModelConfig
from moeflow.moe.experts import SharedExpert, matmul_dtypes
from moeflow.moe.layer import MoE

H, F, K = 256, 512, 2
EXPERTS = (8, 16, 32, 64)


def _sync(x: torch.Tensor) -> None:
    if x.is_cuda:  # GPU work is asynchronous: time it to its end
        torch.cuda.synchronize(x.device)


def tokens_per_s(modules: dict[str, torch.nn.Module], x: torch.Tensor, repeats: int, precision: str
                 ) -> dict[str, tuple[float, float]]:
    """Each module's tokens/s in its least disturbed timed pass, and the process's minor page faults per timed
    pass. The modules take turns, pass by pass, so that a disturbance falls on all of them alike. Each pass
    starts without gradients (`zero_grad(set_to_none=True)`), as each training step does (moe/train.py)."""
    inputs = {name: x.clone().requires_grad_() for name in modules}

    def step(name: str) -> None:
        module, inp = modules[name], inputs[name]
        module.zero_grad(set_to_none=True)
        inp.grad = None
        with _precision(x.device, precision):
            out = module(inp)
        y = out[0] if isinstance(out, tuple) else out
        y.float().square().mean().backward()
        _sync(x)

    times: dict[str, list[float]] = {name: [] for name in modules}
    faults = dict.fromkeys(modules, 0)
    for rep in range(2 + repeats):  # two warm-up rounds
        for name in modules:
            f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            step(name)
            if rep >= 2:
                times[name].append(time.perf_counter() - t0)
                faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    # the least disturbed repeat, as timeit does
    return {name: (x.shape[0] / min(times[name]), faults[name] / repeats) for name in modules}


def per_token_loop(layer: MoE, x: torch.Tensor) -> float:
    """Tokens/s of a forward pass that visits each token's experts one token at a time."""
    mlp = layer.experts.mlp
    w1, v1, w2 = (w.view(mlp.num_experts, F, H) for w in (mlp.w1, mlp.v1, mlp.w2))
    t0 = time.perf_counter()
    with torch.no_grad():
        r = layer.router(x)
        for t in range(x.shape[0]):
            for k in range(K):
                e = int(r.experts_TK[t, k])
                h = torch.nn.functional.silu(x[t] @ w1[e].T) * (x[t] @ v1[e].T)
                _ = r.weights_TK[t, k] * (h @ w2[e])
    return x.shape[0] / (time.perf_counter() - t0)


def _precision(dev: torch.device, precision: str):
    return torch.autocast(dev.type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext()


def scaling(tokens: int, repeats: int, dev: torch.device, precision: str) -> dict:
    torch.manual_seed(0)
    x = torch.randn(tokens, H, device=dev)
    out: dict = {}
    modules: dict[str, torch.nn.Module] = {"dense": SharedExpert(H, K * F, glu=True).to(dev)}
    for e in EXPERTS:
        cfg = ModelConfig(d_model=H, n_heads=4, num_experts=e, top_k=K, expert_hidden=F)
        modules[f"e{e}"] = MoE(cfg).to(dev)
    dtypes: set[str] = set()
    for e in EXPERTS:  # an untimed forward pass each: the dispatch mode that watches would slow the timed ones
        with matmul_dtypes(modules[f"e{e}"]) as seen, _precision(dev, precision), torch.no_grad():
            modules[f"e{e}"](x)
        dtypes |= seen
    speeds = tokens_per_s(modules, x, repeats, precision)
    out["dense_tokens_per_s"] = round(speeds["dense"][0], 1)
    for e in EXPERTS:
        speed, faults = speeds[f"e{e}"]
        out[f"e{e}_tokens_per_s"], out[f"e{e}_page_faults_per_pass"] = round(speed, 1), round(faults)
    out["expert_matmul_dtype"] = ",".join(sorted(dtypes))
    for e in (16, 32, 64):
        out[f"e{e}_vs_e8"] = round(out[f"e{e}_tokens_per_s"] / out["e8_tokens_per_s"], 3)
    out["moe_e8_vs_dense_ratio"] = round(out["e8_tokens_per_s"] / out["dense_tokens_per_s"], 3)
    print(
        f"{tokens:6d} tokens: dense {out['dense_tokens_per_s']:.0f} tokens/s; "
        + "; ".join(f"{e} experts {out[f'e{e}_tokens_per_s']:.0f}" for e in (8, 16, 32, 64))
        + f"; 64 vs 8 experts {out['e64_vs_e8']}; MoE(8) / dense {out['moe_e8_vs_dense_ratio']}"
        + f"; page faults per pass (8, 64 experts) {out['e8_page_faults_per_pass']}, {out['e64_page_faults_per_pass']}",
        flush=True,
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16: under autocast")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="intra-op threads (default: all cores)")
    args = p.parse_args()
    if args.threads < 1:
        p.error(f"--threads {args.threads}: give 1 or more (default: all {os.cpu_count()} cores)")
    dev = torch.device(args.device)
    torch.set_num_threads(args.threads)
    figures: dict[str, float] = {
        "threads": torch.get_num_threads(),
        "hidden": H,
        "expert_hidden": F,
        "top_k": K,
        "device": args.device,
        "precision": args.precision,
    }
    for tokens in args.tokens:
        out = scaling(tokens, args.repeats, dev, args.precision)
        figures["expert_matmul_dtype"] = out.pop("expert_matmul_dtype")
        figures.update({f"t{tokens}_{k}": v for k, v in out.items()})
    layer = MoE(ModelConfig(d_model=H, n_heads=4, num_experts=8, top_k=K, expert_hidden=F))
    small = torch.randn(256, H)
    with torch.no_grad():
        times = []
        for _ in range(args.repeats + 2):
            t0 = time.perf_counter()
            layer(small)
            times.append(time.perf_counter() - t0)
        fwd = small.shape[0] / min(times[2:])
    figures["per_token_loop_forward_tokens_per_s"] = round(per_token_loop(layer, small), 1)
    figures["reference_vs_per_token_loop"] = round(fwd / figures["per_token_loop_forward_tokens_per_s"], 1)
    print(f"reference forward vs a per-token loop: {figures['reference_vs_per_token_loop']}x")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
