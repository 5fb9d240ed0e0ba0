"""Keying local sources by the xxh3 of their files: a cold hash cache, a warm one, and the stat-only listing the
key was before.

Run: `python benchmarks/keying.py [--repeats 10]` (fetches `python3.11-doc` and `linux-doc-6.1` if needed).
The tiny preset's two package sources (the Python docs' `.rst.txt` files and the kernel's `.rst.gz` ones) are
read as local sources pointing into the fetched trees, and keyed as the `sources` and `ingest` stages key
them (`ingest.sources_stage.local_files`), with a data cache of its own for the hashes:
- cold: the hash cache removed before each repeat, so every file is read and hashed (the best repeat);
- warm: the cache as the cold run left it, so every file is listed and stat'ed and its hash looked up (best);
- stat only: listing and stat'ing the same files, what the key read before it held hashes (best);
- the fetched trees' own checks, over every file they hold (more than the sources read): the stat signature
  each reading stage's key checks, and the content digest it falls back to when that differs (best).
What it does not show: reading from disk. The files are in the OS page cache after the first read, so cold is
hashing from memory plus the cache's writes; a first keying after a reboot or of a corpus larger than memory
reads at the disk's speed. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from moeflow import configs
from moeflow.ingest.resolve import resolve_source
from moeflow.ingest.sources_stage import local_files
from moeflow.sources import fetch, integrity

PACKAGES = ("python3.11-doc", "linux-doc-6.1")


def bests(runs: dict, repeats: int) -> dict[str, float]:
    """The best seconds of each run {name: (before, fn)}; the runs take turns, so a load from elsewhere falls on
    all of them alike, and each round's warm run follows its cold one."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (before, fn) in runs.items():
            before()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: min(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    for name in PACKAGES:
        fetch.fetch(name)
    sources = tuple(s.model_copy(update={"package": None, "path": str(fetch.tree(s.package) / s.path)})
                    for s in configs.load("tiny").sources if s.package in PACKAGES)
    trees = [fetch.tree(name) for name in PACKAGES]
    files = [f for s in sources for f in resolve_source(s).files]
    nothing = lambda: None  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MOEFLOW_CACHE"] = tmp  # the hashes' cache only: the trees were found above
        hashes = Path(tmp) / "hashes"
        t = bests({
            "cold": (lambda: shutil.rmtree(hashes, ignore_errors=True), lambda: local_files(sources)),
            "warm": (nothing, lambda: local_files(sources)),
            "stat_only": (nothing, lambda: [f.stat() for s in sources for f in resolve_source(s).files]),
            "tree_stat_signature": (nothing, lambda: [integrity.stat_signature(t) for t in trees]),
            "tree_content_digest": (nothing, lambda: [integrity.content_digest(t) for t in trees]),
        }, args.repeats)
        entries = sum(len(json.loads(p.read_text())) for p in hashes.glob("*.json"))
    figures = {
        "files": len(files),
        "mb": round(sum(f.stat().st_size for f in files) / 1e6, 1),
        "cached_entries": entries,
        "cold_s": round(t["cold"], 3),
        "warm_s": round(t["warm"], 4),
        "stat_only_s": round(t["stat_only"], 4),
        "warm_over_stat_only_ratio": round(t["warm"] / t["stat_only"], 2),
        "cold_over_warm_ratio": round(t["cold"] / t["warm"], 1),
        "tree_files": sum(1 for t in trees for p in t.rglob("*") if p.is_file()),
        "tree_stat_signature_s": round(t["tree_stat_signature"], 4),
        "tree_content_digest_s": round(t["tree_content_digest"], 3),
    }
    print(f"{figures['files']:,} files, {figures['mb']} MB: cold {figures['cold_s']} s, warm {figures['warm_s']} s, "
          f"stat only {figures['stat_only_s']} s; the trees' ({figures['tree_files']:,} files) stat signature "
          f"{figures['tree_stat_signature_s']} s, content digest {figures['tree_content_digest_s']} s")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
