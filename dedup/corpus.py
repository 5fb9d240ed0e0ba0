"""Corpus deduplication as a distributed reduce: exact (xxh3 of the normalised text), then MinHash LSH.

Each cluster keeps one deterministic representative, its smallest document id; the others are
recorded in the ledger as duplicates of it (`exact`, or `minhash` with the estimated similarity).
The stage runs as four phases of tasks, each part its own artifact, so no task holds the corpus:

- `sign`, per record shard: every document's exact hash, and one MinHash signature per distinct
  normalised text (copies share it), written as rows partitioned by hash (exact) and by band bucket.
- `pairs`, per partition: exact groups (the smallest id of each hash), and for every band bucket with
  two or more texts the pairs (the bucket's smallest id, each other one) whose estimated similarity
  reaches the threshold, written to disk as edges.
- `clusters`, one task: connected components of the edges (union-find); each component's smallest id
  is its representative, and every other member's similarity to it is recorded.
- `shard`, per record shard: the documents with their fates, joined in order by `merge`.

What grows with the corpus: the `clusters` task holds the near-duplicate edges and their texts (not the
corpus), and the `shard` tasks read the near-duplicate table whole. The output is the same for any
number of shards and partitions. A worker's memory otherwise does not grow with the corpus: a part holds
one row group of documents and its shard's rows; each part gives back what it freed (`release`), since a
worker runs many parts in turn and its allocators would keep every part's leftovers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from moeflow.configs import DedupConfig
from moeflow.core.documents import DocWriter, count_docs, iter_docs, iter_tables, join, shard_rows
from moeflow.core.ledger import Ledger
from moeflow.core.progress import tqdm
from moeflow.dedup import minhash

_SPACE = re.compile(r"\s+")
EXACT = pa.schema([("hash", pa.uint64()), ("id", pa.string()), ("pos", pa.int64())])
BANDS = pa.schema(
    [("band", pa.uint16()), ("bucket", pa.uint64()), ("hash", pa.uint64()), ("id", pa.string())]
)
DUPS = pa.schema([("pos", pa.int64()), ("rep", pa.string())])
EDGES = pa.schema([("a", pa.uint64()), ("a_id", pa.string()), ("b", pa.uint64()), ("b_id", pa.string())])
NEAR = pa.schema([("hash", pa.uint64()), ("rep", pa.string()), ("similarity", pa.float64())])
_ZSTD = pa.ipc.IpcWriteOptions(compression="zstd", use_threads=False)  # same bytes; allocations on this thread
ROWS_PER_PARTITION = 1_000_000  # band rows a `pairs` task holds, about, when `dedup.partitions` is unset
BLOCK = 4096  # rows spilled, and texts whose signatures and band rows are written, at once


def normalise(text: str, lowercase: bool = True) -> str:
    text = _SPACE.sub(" ", text).strip()
    return text.lower() if lowercase else text


def _write(path: Path, table: pa.Table) -> None:
    with pa.ipc.new_file(path, table.schema, options=_ZSTD) as w:
        w.write_table(table, max_chunksize=65_536)


def _read(path: Path) -> pa.Table:
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).read_all()


def _partition(table: pa.Table, column: str, n: int) -> list[pa.Table]:
    which = pa.array(table.column(column).to_numpy() % np.uint64(n))
    return [table.filter(pc.equal(which, p)) for p in range(n)]


class _Spill:
    """Rows appended in arrival order and written a block at a time to one IPC file per partition of
    `column` (or to one file when `parts` is None): memory holds a block."""

    def __init__(self, out: Path, name: str, schema: pa.Schema, column: str, parts: int | None,
                 compress: bool = True):
        files = [f"{name}-{p:04d}.arrow" for p in range(parts)] if parts else [f"{name}.arrow"]
        opts = _ZSTD if compress else None
        self.writers = [pa.ipc.new_file(out / f, schema, options=opts) for f in files]
        self.schema, self.column, self.parts = schema, column, parts
        self.rows: dict[str, list] = {k: [] for k in schema.names}

    def add(self, *values) -> None:
        for k, v in zip(self.schema.names, values):
            self.rows[k].append(v)
        if len(self.rows[self.column]) == BLOCK:
            self.flush()

    def flush(self) -> None:
        table = pa.table(self.rows, schema=self.schema)
        for w, t in zip(self.writers, _partition(table, self.column, self.parts) if self.parts else [table]):
            w.write_table(t)
        self.rows = {k: [] for k in self.schema.names}

    def close(self) -> None:
        self.flush()
        for w in self.writers:
            w.close()


def partitions(cfg: DedupConfig, docs_dir: Path) -> int:
    """The reduce partitions: `cfg.partitions`, or where unset as many as keep a `pairs` task's band rows
    under about `ROWS_PER_PARTITION` (documents x bands, an upper bound: one band row per distinct text
    in each shard), at least 4."""
    return cfg.partitions or max(4, -(-count_docs(docs_dir) * cfg.bands // ROWS_PER_PARTITION))


def sign(cfg: DedupConfig, docs_dir: Path, out: Path, part: tuple[int, int]) -> dict:
    """Phase `sign` for record shard `part`: exact rows and (MinHash on) signatures and band rows, split
    into `partitions` by hash. Rows go to disk as they come; memory holds each distinct text's hash and
    smallest id."""
    reduce = partitions(cfg, docs_dir)
    start = shard_rows(count_docs(docs_dir), part).start
    width = cfg.bands * cfg.rows
    perms = minhash.permutations(width, cfg.seed) if cfg.minhash else None
    exact = _Spill(out, "exact", EXACT, "hash", reduce)
    raw_schema = pa.schema([("hash", pa.uint64()), ("sig", pa.binary(width * 8))])
    raw = _Spill(out, ".unsorted", raw_schema, "hash", None, compress=False)
    first: dict[int, str] = {}  # hash -> the smallest id of this part's documents with that text
    rows = iter_docs(docs_dir, columns=["id", "text"], shard=part, use_threads=False)
    n = 0
    for pos, row in enumerate(tqdm(rows, total=count_docs(docs_dir, part), unit="doc", mininterval=5,
                                   desc=f"dedup sign {part[0]}/{part[1]}"), start):
        norm = normalise(row["text"], cfg.lowercase)
        h = xxhash.xxh3_64_intdigest(norm.encode())
        exact.add(h, row["id"], pos)
        n += 1
        if h not in first:
            first[h] = row["id"]
            if perms is not None:
                raw.add(h, minhash.signature(norm, cfg.ngram, perms).tobytes())
        elif row["id"] < first[h]:
            first[h] = row["id"]
    exact.close()
    raw.close()
    if perms is not None:
        _write_signatures(cfg, first, out, reduce)
    (out / ".unsorted.arrow").unlink()
    return {"documents": n, "texts": len(first)}


def _write_signatures(cfg: DedupConfig, first: dict[int, str], out: Path, reduce: int) -> None:
    """`sigs.arrow`: (hash, id, signature) sorted by hash, from the unsorted spill (memory-mapped);
    `bands-*.arrow`: one row per band of each text. A block of `BLOCK` texts at a time."""
    width = cfg.bands * cfg.rows
    sig_schema = pa.schema(
        [("hash", pa.uint64()), ("id", pa.string()), ("sig", pa.list_(pa.uint64(), width))])
    bands = [pa.ipc.new_file(out / f"bands-{p:04d}.arrow", BANDS, options=_ZSTD)
             for p in range(reduce)]
    raw = _read(out / ".unsorted.arrow")
    all_hashes = raw.column("hash").to_numpy()
    order = np.argsort(all_hashes, kind="stable")
    rows = _rows(raw.column("sig"), width)
    with pa.ipc.new_file(out / "sigs.arrow", sig_schema) as writer:
        for i in range(0, len(order), BLOCK):
            at = order[i:i + BLOCK]
            hashes, sigs = all_hashes[at], rows(at)
            ids = pa.array([first[h] for h in hashes.tolist()], pa.string())
            flat = pa.FixedSizeListArray.from_arrays(pa.array(sigs.reshape(-1)), width)
            writer.write_table(pa.table({"hash": hashes, "id": ids, "sig": flat}, schema=sig_schema))
            for p, t in enumerate(_partition(_band_rows(cfg, hashes, ids, sigs), "bucket", reduce)):
                bands[p].write_table(t)
    for w in bands:
        w.close()


def _rows(column: pa.ChunkedArray, width: int):
    """Gather rows of a memory-mapped column of `width` uint64s (fixed-size lists, or fixed-size binary)
    by index, without concatenating its chunks (Arrow's `take` would copy the whole column first)."""
    views = [(c.flatten().to_numpy() if pa.types.is_fixed_size_list(c.type) else
              np.frombuffer(c.buffers()[1], np.uint64, count=len(c) * width, offset=c.offset * width * 8))
             .reshape(-1, width) for c in column.chunks]
    starts = np.cumsum([0] + [len(c) for c in column.chunks])

    def gather(at: np.ndarray) -> np.ndarray:
        chunk = np.searchsorted(starts, at, side="right") - 1
        out = np.empty((len(at), width), np.uint64)
        for c in np.unique(chunk).tolist():
            sel = chunk == c
            out[sel] = views[c][at[sel] - starts[c]]
        return out

    return gather


def _band_rows(cfg: DedupConfig, hashes: np.ndarray, ids: pa.Array, sigs: np.ndarray) -> pa.Table:
    """One row per (text, band): the band's bucket, a hash of its `rows` slots."""
    buckets = np.empty((len(hashes), cfg.bands), np.uint64)
    for b in range(cfg.bands):
        block = np.ascontiguousarray(sigs[:, b * cfg.rows:(b + 1) * cfg.rows])
        buckets[:, b] = [xxhash.xxh3_64_intdigest(r.tobytes()) for r in block]
    return pa.table({
        "band": pa.array(np.tile(np.arange(cfg.bands, dtype=np.uint16), len(hashes))),
        "bucket": pa.array(buckets.reshape(-1)),
        "hash": pa.array(np.repeat(hashes, cfg.bands)),
        "id": ids.take(pa.array(np.repeat(np.arange(len(hashes)), cfg.bands))),
    }, schema=BANDS)


def signatures(sign_dirs: list[Path], wanted: np.ndarray) -> dict[int, np.ndarray]:
    """The signatures of the texts `wanted` (by hash), read from the `sign` parts' sorted tables."""
    wanted = np.unique(wanted.astype(np.uint64))
    best: dict[int, tuple[str, np.ndarray]] = {}
    for d in sign_dirs if wanted.size else []:
        table = _read(d / "sigs.arrow")
        hashes = table.column("hash").to_numpy()
        at = np.minimum(np.searchsorted(hashes, wanted), max(len(hashes) - 1, 0))
        found = at[hashes[at] == wanted] if len(hashes) else at[:0]
        sig = _rows(table.column("sig"), table.schema.field("sig").type.list_size)(found)
        ids = table.column("id").take(pa.array(found)).to_pylist()
        for h, i, s in zip(hashes[found].tolist(), ids, sig):
            if h not in best or i < best[h][0]:
                best[h] = (i, s)
    return {h: s for h, (_, s) in best.items()}


def pairs(cfg: DedupConfig, sign_dirs: list[Path], out: Path, part: tuple[int, int]) -> dict:
    """Phase `pairs` for hash partition `part`: exact duplicates, and verified near-duplicate edges."""
    p = part[0]
    exact = _sorted(pa.concat_tables([_read(d / f"exact-{p:04d}.arrow") for d in sign_dirs]), ["hash", "id"])
    first, rep = _groups(exact.column("hash").to_numpy())
    ids = exact.column("id")
    is_dup = pc.not_equal(ids, ids.take(pa.array(rep))).to_numpy(zero_copy_only=False)
    dups = pa.table({"pos": exact["pos"].filter(is_dup), "rep": ids.take(pa.array(rep[is_dup]))},
                    schema=DUPS).sort_by("pos")
    _write(out / "exact.arrow", dups)
    counts = np.diff(np.append(np.flatnonzero(first), len(first)))
    sizes = Counter(str(n) for n in counts[counts > 1].tolist())
    edges = _edges(cfg, sign_dirs, p) if cfg.minhash else EDGES.empty_table()
    _write(out / "edges.arrow", edges)
    return {"exact_groups": dict(sorted(sizes.items(), key=_by_int)), "exact_duplicates": dups.num_rows,
            "edges": edges.num_rows}


def _sorted(table: pa.Table, keys: list[str]) -> pa.Table:
    return table.take(pc.sort_indices(table, [(k, "ascending") for k in keys]))


def _groups(*keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows sorted by `keys`: whether each row starts a run of equal keys, and the index of its run's
    first row. (Sorting and numpy, not Arrow's group_by and join: those hold some 50 MB of native memory
    even for a few hundred rows, which a worker then keeps.)"""
    n = len(keys[0])
    first = np.ones(n, bool)
    for k in keys:
        first[1:] &= k[1:] == k[:-1]
    first[1:] = ~first[1:]
    return first, np.flatnonzero(first)[np.cumsum(first) - 1]


def _edges(cfg: DedupConfig, sign_dirs: list[Path], p: int) -> pa.Table:
    """Candidate pairs of the band buckets in partition `p`: each bucket's smallest id with every other text
    in it (a text's id: the smallest id of its copies), kept when the estimated similarity reaches the
    threshold."""
    rows = _sorted(pa.concat_tables([_read(d / f"bands-{p:04d}.arrow") for d in sign_dirs]),
                   ["band", "bucket", "hash", "id"])
    band, bucket = rows.column("band").to_numpy(), rows.column("bucket").to_numpy()
    first, _ = _groups(band, bucket, rows.column("hash").to_numpy())  # a text's first row: its smallest id
    rows = rows.filter(first)
    band, bucket = band[first], bucket[first]
    start, _ = _groups(band, bucket)
    shared = np.bincount(np.cumsum(start) - 1)[np.cumsum(start) - 1] > 1  # buckets of two texts or more
    rows = _sorted(rows.filter(shared), ["band", "bucket", "id"])
    start, anchor = _groups(rows.column("band").to_numpy(), rows.column("bucket").to_numpy())
    h, i = rows.column("hash").to_numpy(), rows.column("id").to_pylist()
    found = {(int(h[a]), i[a], int(h[k]), i[k]) for k, a in enumerate(anchor.tolist()) if k != a}
    sigs = signatures(sign_dirs, np.array([x for a, _, b, _ in found for x in (a, b)], np.uint64))
    kept = sorted(e for e in found if minhash.similarity(sigs[e[0]], sigs[e[2]]) >= cfg.threshold)
    return pa.table({name: [e[k] for e in kept] for k, name in enumerate(EDGES.names)}, schema=EDGES)


def clusters(cfg: DedupConfig, sign_dirs: list[Path], pair_dirs: list[Path], out: Path) -> dict:
    """Phase `clusters`: connected components of every partition's edges; each non-representative text
    with its component's smallest id and its estimated similarity to it."""
    edges = pa.concat_tables([_read(d / "edges.arrow") for d in pair_dirs])
    parent: dict[int, int] = {}
    name: dict[int, str] = {}

    def find(x: int) -> int:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, a_id, b, b_id in zip(*(edges.column(c).to_pylist() for c in EDGES.names)):
        name[a], name[b] = a_id, b_id
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    members: dict[int, list[int]] = {}
    for h in name:
        members.setdefault(find(h), []).append(h)
    reps = {root: min(ms, key=name.__getitem__) for root, ms in members.items()}
    sigs = signatures(sign_dirs, np.array(list(name), np.uint64))
    near = sorted((h, name[reps[find(h)]], round(minhash.similarity(sigs[h], sigs[reps[find(h)]]), 4))
                  for h in name if h != reps[find(h)])
    _write(out / "near.arrow",
           pa.table({k: [r[i] for r in near] for i, k in enumerate(NEAR.names)}, schema=NEAR))
    sizes = Counter(str(len(ms)) for ms in members.values())
    return {"minhash_clusters": len(members),
            "minhash_cluster_sizes": dict(sorted(sizes.items(), key=_by_int))}


def _by_int(item: tuple[str, int]) -> int:
    return int(item[0])


def write_shard(docs_dir: Path, sign_dir: Path, pair_dirs: list[Path], near_dir: Path, out: Path,
                part: tuple[int, int]) -> dict:
    """Phase `shard`: record shard `part`'s documents with their fates (kept, exact or minhash duplicate).
    The documents stay Arrow tables, filtered to the kept rows: a text's hash comes from its `sign` part
    (the same record shard), so no text becomes a Python string or is normalised again."""
    rows = shard_rows(count_docs(docs_dir), part)
    exact = _exact_reps(pair_dirs, rows)
    near = _near_reps(near_dir, _text_hashes(sign_dir, rows), rows.start)
    ledger = Ledger("dedup", out)
    with DocWriter(out) as writer:
        pos = rows.start
        for table in iter_tables(docs_dir, shard=part, use_threads=False):
            keep = np.ones(table.num_rows, bool)
            for k, doc_id in enumerate(table.column("id").to_pylist()):
                of = near.get(pos + k)
                if pos + k in exact:
                    ledger.add(doc_id, "duplicate", "exact", exact[pos + k])
                elif of is not None and of[0] != doc_id:
                    ledger.add(doc_id, "duplicate", "minhash", json.dumps({"of": of[0], "similarity": of[1]}))
                else:
                    ledger.kept(doc_id)
                    continue
                keep[k] = False
            writer.write_table(table.filter(keep))
            pos += table.num_rows
        n_out = writer.count
    ledger.write()
    return ledger.check(len(rows), n_out)


def _exact_reps(pair_dirs: list[Path], rows: range) -> dict[int, str]:
    """Position -> representative id of the exact duplicates among `rows`."""
    exact: dict[int, str] = {}
    for d in pair_dirs:
        t = _read(d / "exact.arrow")
        pos = t.column("pos").to_numpy()
        lo, hi = np.searchsorted(pos, rows.start), np.searchsorted(pos, rows.stop)
        exact.update(zip(pos[lo:hi].tolist(), t.column("rep").slice(lo, hi - lo).to_pylist()))
    return exact


def _text_hashes(sign_dir: Path, rows: range) -> np.ndarray:
    """The normalised text's hash of each document of `rows`, in order, from the `sign` part of these rows."""
    spilled = pa.concat_tables([_read(f) for f in sorted(sign_dir.glob("exact-*.arrow"))])
    pos = spilled.column("pos").to_numpy()
    if not np.array_equal(np.sort(pos), np.arange(rows.start, rows.stop)):
        raise RuntimeError(f"dedup: the sign part {sign_dir} does not hold rows {rows.start}-{rows.stop}")
    hashes = np.empty(len(rows), np.uint64)
    hashes[pos - rows.start] = spilled.column("hash").to_numpy()
    return hashes


def _near_reps(near_dir: Path, hashes: np.ndarray, start: int) -> dict[int, tuple[str, float]]:
    """Position -> (representative id, similarity) of the texts in `near.arrow` among `hashes` (of the
    documents from position `start` on)."""
    near = _read(near_dir / "near.arrow")  # sorted by hash, each once
    known = near.column("hash").to_numpy()
    at = np.minimum(np.searchsorted(known, hashes), max(len(known) - 1, 0))
    hit = np.flatnonzero(known[at] == hashes) if len(known) else np.empty(0, np.int64)
    reps, sims = near.column("rep").to_pylist(), near.column("similarity").to_pylist()
    return {start + int(k): (reps[at[k]], sims[at[k]]) for k in hit}


def _libc_trim():
    libc = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None  # glibc's; absent elsewhere


_TRIM = _libc_trim()


def release() -> None:
    """Give the memory a part has freed back to the system: Arrow's pool (mimalloc) and glibc's malloc each
    keep freed pages for reuse, apart, so a worker running part after part held the largest of each part's
    leftovers at once (corpus_scale at 16x, 42 parts in one worker: RSS about 90 MB above the imports
    between parts, with no Arrow buffer live; with this, about 50 MB)."""
    pa.default_memory_pool().release_unused()
    if _TRIM is not None:
        _TRIM(0)


def _released(body):
    @functools.wraps(body)
    def run(*args, **kwargs):
        try:
            return body(*args, **kwargs)
        finally:
            release()

    return run


@_released
def merge(cfg: DedupConfig, prior: dict[str, list[Path]], out: Path) -> dict:
    """Join the `shard` parts in order; the cluster statistics from `pairs` and `clusters`."""
    stats = [json.loads((d / "manifest.json").read_text())["stats"] for d in prior["pairs"]]
    sizes: Counter = Counter()
    for s in stats:
        sizes.update(s["exact_groups"])
    near = json.loads((prior["clusters"][0] / "manifest.json").read_text())["stats"]
    return {
        **join(prior["shard"], out, "dedup"),
        "duplicate_clusters": sum(sizes.values()),
        "cluster_sizes": dict(sorted(sizes.items(), key=_by_int)),
        **near,
        "shards": len(prior["shard"]),
        "partitions": len(prior["pairs"]),
    }


# The phases as the stage declares them: (slice, inputs, prior, out, part)
def sign_part(cfg, inputs, prior, out, part):
    return sign(cfg, inputs["docs"].dir, out, part)


def pairs_part(cfg, inputs, prior, out, part):
    return pairs(cfg, prior["sign"], out, part)


def clusters_part(cfg, inputs, prior, out, part):
    return clusters(cfg, prior["sign"], prior["pairs"], out)


def shard_part(cfg, inputs, prior, out, part):
    return write_shard(inputs["docs"].dir, prior["sign"][part[0]], prior["pairs"], prior["clusters"][0], out, part)


PHASES = tuple((name, _released(body)) for name, body in
               (("sign", sign_part), ("pairs", pairs_part), ("clusters", clusters_part), ("shard", shard_part)))
