"""Object store: the smoke preset's data stages with the store on local disk vs on a local S3 server.

Run: `python benchmarks/store.py [--preset smoke] [--repeats 3]` (fetches the preset's packages into the data
cache when they are not there; starts moto's S3 server on a free port of 127.0.0.1 and stops it).

Each repeat runs the data stages, `sources` through `mix`, in flow order through `tasks.runner.materialize`
(keys, input verification, commits; `force`, so every stage builds), once into a fresh local store and once
into a fresh prefix of the S3 server, the two interleaved. On S3 every stage starts with an empty mirror, as
if each ran on a node of its own: it downloads and verifies its inputs, builds in a local staging folder,
uploads, then writes the manifest. Per stage: the best wall-clock seconds of each side and their ratio, and
the bytes the S3 side moved (counted at fsspec's calls: uploads, downloads, manifest and lease objects). The
last line is one JSON object with `s3_over_local_ratio` (sum of S3 bests / sum of local bests).

What it does not show: a real network (the server is on loopback, so latency per request is far below a
cloud bucket's), S3 request costs, Ray or Prefect scheduling (stages run in this process, one part per
phase), or scale: the smoke corpus is small, so the ratios lean on per-request overhead more than on bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the test suite's S3 server launcher

MOVED: Counter = Counter()  # "up"/"down" -> bytes, for the stage being timed


def _count_transfers() -> None:
    """Count the bytes s3fs moves (its sync methods, as the store calls them)."""
    import s3fs

    fs = s3fs.S3FileSystem
    put, get, get_file, cat_file, pipe_file = fs.put, fs.get, fs.get_file, fs.cat_file, fs.pipe_file

    def _put(self, lpath, rpath, *a, **k):
        MOVED["up"] += sum(os.path.getsize(p) for p in (lpath if isinstance(lpath, list) else [lpath]))
        return put(self, lpath, rpath, *a, **k)

    def _get(self, rpath, lpath, *a, **k):
        out = get(self, rpath, lpath, *a, **k)
        MOVED["down"] += sum(os.path.getsize(p) for p in (lpath if isinstance(lpath, list) else [lpath]))
        return out

    def _get_file(self, rpath, lpath, *a, **k):
        out = get_file(self, rpath, lpath, *a, **k)
        MOVED["down"] += os.path.getsize(lpath)
        return out

    def _cat_file(self, *a, **k):
        out = cat_file(self, *a, **k)
        MOVED["down"] += len(out)
        return out

    def _pipe_file(self, path, value, *a, **k):
        MOVED["up"] += len(value)
        return pipe_file(self, path, value, *a, **k)

    fs.put, fs.get, fs.get_file, fs.cat_file, fs.pipe_file = _put, _get, _get_file, _cat_file, _pipe_file


class Timed:
    """A `run` for `flows.pretrain.dag`: builds each stage (forced) and times it, stopping after `mix`."""

    def __init__(self, cfg, mirrors: Path | None):
        self.cfg, self.mirrors, self.done = cfg, mirrors, False
        self.seconds: dict[str, float] = {}
        self.moved: dict[str, dict] = {}

    def subflow(self, *args):
        return None

    def __call__(self, declared, *, cfg=None, label=None, **inputs):
        from moeflow.tasks.runner import materialize

        if self.done:
            return None
        stage = declared.name
        if self.mirrors is not None:  # an empty mirror: this stage runs on a node of its own
            os.environ["MOEFLOW_STORE_CACHE"] = tempfile.mkdtemp(dir=self.mirrors)
        MOVED.clear()
        t0 = time.perf_counter()
        manifest = materialize(stage, cfg or self.cfg, inputs, force=True)
        self.seconds[stage] = time.perf_counter() - t0
        self.moved[stage] = dict(MOVED)
        self.done = stage == "mix"
        return manifest


def run_once(preset: str, store: str, mirrors: Path | None) -> Timed:
    from helpers import write_config
    from moeflow import configs
    from moeflow.flows.pretrain import dag

    path = write_config(Path(tempfile.mkdtemp()) / f"{preset}.yaml", base=preset, store=store)
    cfg = configs.load(str(path))
    timed = Timed(cfg, mirrors)
    dag(timed, cfg)
    return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="smoke", help="config preset whose data stages run (default: smoke)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per side; a stage's best counts (default 3)")
    args = ap.parse_args()
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "moeflow-benchmark")
    from s3server import S3Server

    from moeflow import configs
    from moeflow.sources import fetch
    from moeflow.sources.stage import packages_for

    for name in packages_for(configs.load(args.preset)):
        fetch.fetch(name)
    work = Path(tempfile.mkdtemp(prefix="moeflow-store-bench-"))
    server = S3Server(work / "moto.log").start()
    os.environ.update(server.env)
    _count_transfers()
    try:
        bucket = server.bucket("bench")
        best: dict[str, dict[str, float]] = {"local": {}, "s3": {}}
        moved: dict[str, dict] = {}
        run_once(args.preset, str(work / "warm"), None)  # imports and first-touch costs, untimed
        for r in range(args.repeats):
            for side in ("local", "s3"):
                store = str(work / f"local{r}") if side == "local" else f"{bucket}/run{r}"
                mirrors = work / f"mirrors{r}" if side == "s3" else None
                if mirrors is not None:
                    mirrors.mkdir()
                timed = run_once(args.preset, store, mirrors)
                moved = timed.moved if side == "s3" else moved
                for stage, s in timed.seconds.items():
                    best[side][stage] = min(best[side].get(stage, s), s)
    finally:
        server.stop()
    report(best, moved, args)


def report(best: dict, moved: dict, args) -> None:
    print(f"{'stage':14s} {'local s':>8s} {'s3 s':>8s} {'ratio':>6s} {'up MB':>8s} {'down MB':>8s}")
    for stage, local in best["local"].items():
        s3, m = best["s3"][stage], moved.get(stage, {})
        print(f"{stage:14s} {local:8.2f} {s3:8.2f} {s3 / local:6.2f} {m.get('up', 0) / 1e6:8.2f} "
              f"{m.get('down', 0) / 1e6:8.2f}")
    total = {side: sum(v.values()) for side, v in best.items()}
    print(json.dumps({
        "preset": args.preset, "repeats": args.repeats, "local_s": round(total["local"], 3),
        "s3_s": round(total["s3"], 3), "s3_over_local_ratio": round(total["s3"] / total["local"], 3),
        "per_stage": {s: {"local_s": round(best["local"][s], 3), "s3_s": round(best["s3"][s], 3),
                          "up_bytes": moved.get(s, {}).get("up", 0),
                          "down_bytes": moved.get(s, {}).get("down", 0)} for s in best["local"]},
    }))


if __name__ == "__main__":
    main()
