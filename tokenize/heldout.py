"""The held-out split: which documents evaluation keeps out of training, and how much of them training sees.

Documents are held out by group, so that every version of a work falls on one side: `mix.heldout.group_by`
(a regular expression over ids) names each id's group, and a group is held out by a hash of its key (stable
whatever else changes), at least one group per domain that has two or more. Grouping by name cannot catch
every copy (an anthology holds a poem that is also a file of its own), so the split is measured: each held-out
document's word n-grams, hashed as decontamination hashes them, are looked up in every training document.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import xxhash

from moeflow.configs import HeldoutConfig
from moeflow.tokenize.ngrams import ngram_hashes
from moeflow.tokenize.store import INDEX, iter_tokens

log = logging.getLogger(__name__)
TOP = 5  # held-out documents with the most overlap named in the stats (all of them in `leakage.json`)
PASS_TOKENS = 20_000_000  # held-out tokens whose n-grams a pass holds (16 bytes an n-gram: about 320 MB)


def _hash(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode())


def is_heldout(key: str, fraction: float) -> bool:
    return _hash(key) % 1_000_000 < fraction * 1_000_000


def group_key(doc_id: str, pattern: re.Pattern | None) -> str:
    """The groups `pattern` captures in `doc_id`, joined by "/"; the id itself when it does not match."""
    m = pattern.search(doc_id) if pattern is not None else None
    return "/".join(g or "" for g in m.groups()) if m else doc_id


def split(by_domain: dict[str, list[str]], cfg: HeldoutConfig) -> tuple[dict, dict]:
    """(train, heldout) ids per domain; a domain of two or more groups holds out at least one, and a group
    falls wholly on one side, in every domain it has documents in."""
    pattern = re.compile(cfg.group_by) if cfg.group_by else None
    key = {d: group_key(d, pattern) for ids in by_domain.values() for d in ids}
    held = {k for k in set(key.values()) if is_heldout(k, cfg.fraction)}
    for _, ids in sorted(by_domain.items()):
        keys = {key[d] for d in ids}
        if len(keys) >= 2 and not keys & held:
            held.add(min(keys, key=_hash))
    heldout = {dom: [d for d in ids if key[d] in held] for dom, ids in sorted(by_domain.items())}
    train = {dom: [d for d in ids if key[d] not in held] for dom, ids in sorted(by_domain.items())}
    return train, heldout


def _ngrams(toks: np.ndarray, tok, n: int) -> np.ndarray:
    return np.unique(ngram_hashes(tok.decode(toks.tolist(), skip_special_tokens=False), n))


class _HeldoutNgrams:
    """Every held-out document's distinct n-grams, sorted by hash with their owner (the held-out set is the
    small side: the training documents stream past it one at a time)."""

    def __init__(self, store_dir: Path, tok, ids: list[str], n: int):
        at = {d: i for i, d in enumerate(ids)}
        hashes, owners = [np.empty(0, np.uint64)], [np.empty(0, np.int64)]
        for doc_id, toks in iter_tokens(store_dir, set(ids)):
            h = _ngrams(toks, tok, n)
            hashes.append(h)
            owners.append(np.full(h.size, at[doc_id], np.int64))
        h, o = np.concatenate(hashes), np.concatenate(owners)
        order = np.argsort(h, kind="stable")
        self.hashes, self.owners = h[order], o[order]
        self.sizes = np.bincount(self.owners, minlength=len(ids))
        self.found = np.zeros(self.hashes.size, bool)

    def lookup(self, h: np.ndarray) -> np.ndarray:
        """Positions in `hashes` of the n-grams in `h` (each once per held-out document that has it)."""
        lo = np.searchsorted(self.hashes, h, "left")
        n = np.searchsorted(self.hashes, h, "right") - lo
        lo, n = lo[n > 0], n[n > 0]
        return np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n) + np.repeat(lo, n)


def leakage(store_dir: Path, tok, train: dict[str, list[str]], heldout: dict[str, list[str]],
            cfg: HeldoutConfig) -> list[dict]:
    """Per held-out document: its distinct word n-grams, how many of them are in some training document
    (`share`), and the training document that holds the most of them; largest share first. The held-out
    documents are taken in passes of at most `PASS_TOKENS` tokens (one over the training documents each), so
    memory follows a pass, not the held-out set."""
    domain_of = {d: dom for dom, ids in heldout.items() for d in ids}
    index = pq.read_table(Path(store_dir) / INDEX, columns=["doc_id", "tokens"]).to_pydict()
    tokens = {d: n for d, n in zip(index["doc_id"], index["tokens"], strict=True) if d in domain_of}
    trained = {d for v in train.values() for d in v}
    rows, batch, size = [], [], 0
    for doc_id in sorted(domain_of):
        batch.append(doc_id)
        size += tokens[doc_id]
        if size >= PASS_TOKENS:
            rows += _pass(store_dir, tok, trained, batch, cfg.ngram)
            batch, size = [], 0
    rows += _pass(store_dir, tok, trained, batch, cfg.ngram) if batch else []
    for r in rows:
        r["domain"] = domain_of[r["doc_id"]]
    return sorted(rows, key=lambda r: (-r["share"], r["doc_id"]))


def _pass(store_dir: Path, tok, trained: set[str], ids: list[str], n: int) -> list[dict]:
    """`leakage` for the held-out documents `ids`: one pass over the training documents."""
    held = _HeldoutNgrams(store_dir, tok, ids, n)
    best = np.zeros(len(ids), np.int64)
    best_doc: list[str | None] = [None] * len(ids)
    for doc_id, toks in iter_tokens(store_dir, trained):
        pos = held.lookup(_ngrams(toks, tok, n))
        if not pos.size:
            continue
        held.found[pos] = True
        shared = np.bincount(held.owners[pos], minlength=len(ids))
        for i in np.flatnonzero((shared > best) | ((shared == best) & (shared > 0))):
            if shared[i] > best[i] or doc_id < best_doc[i]:  # ties: the first id, whatever the store order
                best[i], best_doc[i] = shared[i], doc_id
    seen = np.bincount(held.owners[held.found], minlength=len(ids))
    return [{"doc_id": d, "ngrams": int(held.sizes[i]), "in_training": int(seen[i]),
             "share": round(float(seen[i] / held.sizes[i]), 4) if held.sizes[i] else 0.0,
             "top_training_doc": best_doc[i], "top_shared": int(best[i])} for i, d in enumerate(ids)]


def summary(rows: list[dict], cfg: HeldoutConfig) -> dict:
    """The mix's leakage stats: per domain, the documents above `max_leak` (warned about) and the largest."""
    per_domain: dict[str, dict] = {}
    for r in rows:
        d = per_domain.setdefault(r["domain"], {"documents": 0, "ngrams": 0, "in_training": 0})
        d["documents"] += 1
        d["ngrams"] += r["ngrams"]
        d["in_training"] += r["in_training"]
    for d in per_domain.values():
        d["share"] = round(d["in_training"] / d["ngrams"], 4) if d["ngrams"] else 0.0
    leaks = [r for r in rows if r["share"] > cfg.max_leak]
    for r in leaks:
        log.warning("mix: held-out document %s shares %.1f%% of its %d-grams with training documents "
                    "(most with %s), over mix.heldout.max_leak = %g; group them with mix.heldout.group_by",
                    r["doc_id"], 100 * r["share"], cfg.ngram, r["top_training_doc"], cfg.max_leak)
    return {"ngram": cfg.ngram, "max_leak": cfg.max_leak, "group_by": cfg.group_by,
            "per_domain": dict(sorted(per_domain.items())), "leaks": leaks, "largest": rows[:TOP]}
