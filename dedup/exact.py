"""Exact deduplication: xxh3 of the normalised text; the first document in id order represents its cluster."""

from __future__ import annotations

import re
from pathlib import Path

import xxhash

from moeflow.configs import DedupConfig
from moeflow.documents import DocWriter, iter_docs
from moeflow.lineage.ledger import Ledger

VERSION = 1
_SPACE = re.compile(r"\s+")


def normalise(text: str, lowercase: bool = True) -> str:
    text = _SPACE.sub(" ", text).strip()
    return text.lower() if lowercase else text


def run(cfg: DedupConfig, docs_dir: Path, out: Path) -> dict:
    # Pass 1: the representative of each text hash is the smallest id, so the choice does not
    # depend on the order documents arrive in.
    first: dict[int, str] = {}
    for row in iter_docs(docs_dir, columns=["id", "text"]):
        h = xxhash.xxh3_64_intdigest(normalise(row["text"], cfg.lowercase).encode())
        if h not in first or row["id"] < first[h]:
            first[h] = row["id"]
    ledger = Ledger("dedup")
    n_in = 0
    clusters: dict[str, int] = {}
    with DocWriter(out) as writer:
        for row in iter_docs(docs_dir):
            n_in += 1
            rep = first[xxhash.xxh3_64_intdigest(normalise(row["text"], cfg.lowercase).encode())]
            if rep == row["id"]:
                writer.write(row)
                ledger.kept(row["id"])
            else:
                ledger.add(row["id"], "duplicate", "exact", rep)
                clusters[rep] = clusters.get(rep, 1) + 1
        n_out = writer.count
    ledger.write(out)
    sizes: dict[str, int] = {}
    for size in clusters.values():
        sizes[str(size)] = sizes.get(str(size), 0) + 1
    return {**ledger.check(n_in, n_out), "duplicate_clusters": len(clusters), "cluster_sizes": sizes}
