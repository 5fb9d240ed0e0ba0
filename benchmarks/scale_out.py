"""Data-stage wall time on a local process pool against a local Ray cluster through prefect-ray, same cores.

Run: `python benchmarks/scale_out.py [--shards 2] [--config smoke]` (fetches the packages it reads if
needed). Runs the pretrain flow up to `filter` twice, in fresh artifact stores under a temporary Prefect
server: once with `execution.runner: processes`, once with `ray` (a local Ray instance started by
`RayTaskRunner`, `--workers` CPUs). Reports each run's wall time (Ray's includes starting Ray), the
filter stage's own time, and `ray_over_processes`. The last line is one JSON object.
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="smoke", help="preset or YAML path (default smoke)")
    ap.add_argument("--shards", type=int, default=2, help="filter shards (default 2)")
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="processes / Ray CPUs (default: all cores)")
    args = ap.parse_args()

    from prefect.testing.utilities import prefect_test_harness

    from moeflow import configs
    from moeflow.flows.pretrain import pretrain
    from moeflow.sources import fetch
    from moeflow.tasks.stages import packages_for

    base = yaml.safe_load(configs.resolve(args.config).read_text())
    for name in packages_for(configs.load(args.config)):
        try:
            fetch.fetch(name)
        except fetch.PackageUnavailable:
            pass
    figures: dict = {"config": args.config, "shards": args.shards, "workers": args.workers}
    with tempfile.TemporaryDirectory() as tmp, prefect_test_harness(server_startup_timeout=90):
        for runner in ("processes", "ray"):
            cfg = {**base, "store": str(Path(tmp) / runner), "filter": {**base.get("filter", {}), "shards": args.shards},
                   "execution": {"runner": runner, "workers": args.workers}}
            path = Path(tmp) / f"{runner}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            t0 = time.perf_counter()
            out = pretrain(config=str(path), until="filter")
            wall = time.perf_counter() - t0
            shard_seconds = [json.loads((Path(v["artifact"]) / "lineage.json").read_text())["seconds"]
                             for k, v in out["stages"].items() if k.startswith("filter[")]
            figures[f"{runner}_wall_s"] = round(wall, 1)
            figures[f"{runner}_shard_seconds"] = shard_seconds
            figures[f"{runner}_filter_content_hash"] = out["stages"]["filter"]["content_hash"]
            print(f"{runner:9s}: {wall:6.1f} s to the end of filter; shards took {shard_seconds} s", flush=True)
    figures["ray_over_processes"] = round(figures["ray_wall_s"] / figures["processes_wall_s"], 3)
    figures["same_output"] = figures["ray_filter_content_hash"] == figures["processes_filter_content_hash"]
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
