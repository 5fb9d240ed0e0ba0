"""Benchmark metrics from log-likelihoods (`moe.evaluate` computes those), with lm-evaluation-harness's
conventions; no torch here, as the card reads the per-item records to split clean from contaminated items.

`acc` takes the most likely choice; `acc_norm` divides each choice's log-likelihood by its length in
characters; LAMBADA reports greedy last-word accuracy and perplexity (exp of minus the mean
log-likelihood). Standard errors are the sample standard deviation over the square root of the item
count, as lm-eval's `mean_stderr`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import xxhash

from moeflow.core import ledger
from moeflow.dedup import formats

ITEMS = "benchmarks.jsonl"  # in the evaluate artifact, per item: log-likelihoods, prediction, gold, hits


def sample(items: list[dict], cap: int, seed: int) -> list[dict]:
    """A fixed subset of at most `cap` items per task: the lowest hashes of (seed, item id), in file order."""
    order = sorted(range(len(items)), key=lambda i: xxhash.xxh3_64_intdigest(f"{seed}/{items[i]['item_id']}"))
    keep = set(order[:cap])
    return [x for i, x in enumerate(items) if i in keep]


def judge(item: dict, results: list[tuple[float, bool]]) -> dict:
    """One item's outcome: its log-likelihoods, and whether `acc` / `acc_norm` (or LAMBADA's greedy) hit."""
    lls = np.array([ll for ll, _ in results])
    rec = {"task": item["task"], "benchmark": item["benchmark"], "item_id": item["item_id"],
           "loglikelihoods": lls.tolist(), "gold": item["gold"]}
    if item["task"] == "lambada":
        return {**rec, "acc": float(results[0][1])}
    lengths = np.array([float(len(c)) for c in item["choices"]])
    rec |= {"pred": int(np.argmax(lls)), "acc": float(np.argmax(lls) == item["gold"]),
            "chance": 1 / len(item["choices"])}
    if item["task"] in formats.NORMED:
        rec["acc_norm"] = float(np.argmax(lls / lengths) == item["gold"])
    return rec


def summarise(recs: list[dict]) -> dict:
    """A task's metrics over its judged items: mean and standard error of each, chance, count."""
    out: dict = {"samples": len(recs)}
    for metric in ("acc", "acc_norm"):
        vals = np.array([r[metric] for r in recs if metric in r])
        if vals.size:
            out[metric] = round(float(vals.mean()), 4)
            stderr = vals.std(ddof=1) / math.sqrt(vals.size) if vals.size > 1 else None
            out[f"{metric}_stderr"] = None if stderr is None else round(float(stderr), 4)
    if recs and recs[0]["task"] == "lambada":
        out["perplexity"] = round(math.exp(-float(np.mean([r["loglikelihoods"][0] for r in recs]))), 2)
        out["chance"] = None
    elif recs:
        out["chance"] = round(float(np.mean([r["chance"] for r in recs])), 4)
    return out


def matched_items(decontaminate_dir: Path) -> set[tuple[str, str]]:
    """(benchmark, item id) of every item decontamination found in a training document: the ledger is
    read a row group at a time, and only its matched rows are kept."""
    found = set()
    columns = ("fate", "reason", "detail")
    for batch in pq.ParquetFile(Path(decontaminate_dir) / ledger.LEDGER).iter_batches(columns=list(columns)):
        for fate, reason, detail in zip(*(batch.column(c).to_pylist() for c in columns), strict=True):
            if fate == "contaminated" or reason == "cut":
                d = json.loads(detail)
                found.add((d["benchmark"], d["item_id"]))
    return found


def clean_split(recs: list[dict], matched: set[tuple[str, str]]) -> dict | None:
    """A task's metrics on the items decontamination did not find in training data, when it found some."""
    dirty = [r for r in recs if (r["benchmark"], r["item_id"]) in matched]
    if not dirty:
        return None
    return {"contaminated_samples": len(dirty),
            "clean": summarise([r for r in recs if (r["benchmark"], r["item_id"]) not in matched])}


def read_items(evaluate_dir: Path) -> dict[str, list[dict]]:
    """The evaluate artifact's per-item records, by task; an artifact that scored benchmarks without them
    is an error (its contamination split cannot be made), never "none found"."""
    path = Path(evaluate_dir) / ITEMS
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the evaluate artifact scored benchmarks but holds no per-item "
                                f"records ({ITEMS}); rebuild it: moeflow run CONFIG --rerun evaluate")
    out: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        out.setdefault(rec["task"], []).append(rec)
    return out
