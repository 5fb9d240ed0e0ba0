"""Corpus deduplication: exact (xxh3 of the normalised text), then MinHash LSH near-duplicates of the rest.

Each cluster keeps one deterministic representative, its smallest document id; the others are
recorded in the ledger as duplicates of it (`exact`, or `minhash` with the estimated similarity).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import xxhash
from tqdm import tqdm

from moeflow.configs import DedupConfig
from moeflow.dedup import minhash
from moeflow.documents import DocWriter, iter_docs
from moeflow.lineage.ledger import Ledger

_SPACE = re.compile(r"\s+")


def normalise(text: str, lowercase: bool = True) -> str:
    text = _SPACE.sub(" ", text).strip()
    return text.lower() if lowercase else text


def stage(cfg: DedupConfig, inputs: dict, out: Path) -> dict:
    """The `dedup` stage's body."""
    return run(cfg, inputs["docs"].dir, out)


def run(cfg: DedupConfig, docs_dir: Path, out: Path) -> dict:
    # Pass 1: exact hashes (representative: the smallest id, whatever the arrival order), then
    # MinHash signatures of the exact representatives only.
    first: dict[int, str] = {}
    hash_of: dict[str, int] = {}  # ingest guarantees unique ids
    for row in iter_docs(docs_dir, columns=["id", "text"]):
        h = hash_of[row["id"]] = xxhash.xxh3_64_intdigest(normalise(row["text"], cfg.lowercase).encode())
        if h not in first or row["id"] < first[h]:
            first[h] = row["id"]
    near: dict[str, tuple[str, float]] = {}
    if cfg.minhash:
        reps = set(first.values())
        perms = minhash.permutations(cfg.bands * cfg.rows, cfg.seed)
        ids, sigs = [], []
        for row in tqdm(
            iter_docs(docs_dir, columns=["id", "text"]), desc="minhash", unit="doc", mininterval=5
        ):
            if row["id"] in reps:
                ids.append(row["id"])
                sigs.append(minhash.signature(row["text"], cfg.ngram, perms))
        near = minhash.clusters(ids, sigs, cfg.bands, cfg.rows, cfg.threshold)
    ledger = Ledger("dedup")
    n_in = 0
    exact_clusters: dict[str, int] = {}
    with DocWriter(out) as writer:
        for row in iter_docs(docs_dir):
            n_in += 1
            rep = first[hash_of[row["id"]]]
            if rep != row["id"]:
                ledger.add(row["id"], "duplicate", "exact", rep)
                exact_clusters[rep] = exact_clusters.get(rep, 1) + 1
            elif row["id"] in near and near[row["id"]][0] != row["id"]:
                of, sim = near[row["id"]]
                ledger.add(row["id"], "duplicate", "minhash", json.dumps({"of": of, "similarity": sim}))
            else:
                writer.write(row)
                ledger.kept(row["id"])
        n_out = writer.count
    ledger.write(out)
    near_sizes: dict[str, int] = {}
    for rep in {r for r, _ in near.values()}:
        size = sum(1 for r, _ in near.values() if r == rep)
        near_sizes[str(size)] = near_sizes.get(str(size), 0) + 1
    sizes: dict[str, int] = {}
    for size in exact_clusters.values():
        sizes[str(size)] = sizes.get(str(size), 0) + 1
    return {
        **ledger.check(n_in, n_out),
        "duplicate_clusters": len(exact_clusters),
        "cluster_sizes": sizes,
        "minhash_clusters": sum(near_sizes.values()),
        "minhash_cluster_sizes": dict(sorted(near_sizes.items())),
    }
