"""Sharded Arrow token stores: one row per document (id, source, domain, tokens) in zstd Arrow IPC shards.

`index.parquet` maps every document to its shard, row and token count, so any token traces back to
its document and raw source. Sharded, the stage encodes record shards in parallel (`encode`) and its
join packs them, in order, into the same shards one process writes. Long documents are cut at line
breaks before encoding (one very long document slows `encode_batch` for the whole batch); the pieces'
tokens are concatenated.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moeflow.configs import TokenizerConfig
from moeflow.core.documents import count_docs, iter_docs
from moeflow.core.progress import tqdm
from moeflow.store.format import MANIFEST
from moeflow.tokenize.tokenizer import load as load_tokenizer

INDEX = "index.parquet"
PIECE_CHARS = 16_384
BATCH_CHARS = 4_000_000  # text per encode_batch call: large enough to keep every core busy
BATCH_ROWS = 1024  # documents per record batch of a shard
PART_SCHEMA = pa.schema([("doc_id", pa.string()), ("source", pa.string()), ("domain", pa.string()),
                         ("path", pa.string())])
INDEX_SCHEMA = pa.schema([("doc_id", pa.string()), ("source", pa.string()), ("domain", pa.string()),
                          ("shard", pa.int64()), ("row", pa.int64()), ("tokens", pa.int64())])
_ZSTD = pa.ipc.IpcWriteOptions(compression="zstd")


def token_type(vocab_size: int) -> pa.DataType:
    return pa.uint16() if vocab_size <= 65536 else pa.uint32()


def pieces(text: str, limit: int = PIECE_CHARS) -> list[str]:
    """Cut text after line breaks into pieces of at most about `limit` characters."""
    out, start = [], 0
    while len(text) - start > limit:
        cut = text.rfind("\n", start, start + limit)
        cut = start + limit if cut <= start else cut + 1
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


def encode_docs(tokenizer, texts: list[str], dtype=np.int64) -> list[np.ndarray]:
    """Each text's tokens (`encode_batch_fast`: the ids `encode_batch` gives, without the character offsets
    no one here reads), its pieces' joined."""
    flat, owner = [], []
    for i, text in enumerate(texts):
        for p in pieces(text):
            flat.append(p)
            owner.append(i)
    encs = tokenizer.encode_batch_fast(flat, add_special_tokens=False)
    out: list[list[int]] = [[] for _ in texts]
    for i, enc in zip(owner, encs):
        out[i].extend(enc.ids)
    return [np.asarray(ids, dtype=dtype) for ids in out]


def stage(cfg: TokenizerConfig, inputs: dict, out: Path) -> dict:
    """The `tokenize` stage's body: its `docs` input encoded with its `tokenizer` input."""
    return run(cfg, inputs["docs"].dir, inputs["tokenizer"].dir, out)


def run(cfg: TokenizerConfig, docs_dir: Path, tokenizer_dir: Path, out: Path) -> dict:
    """Write the shards and `index.parquet` into `out`; return stats, with per shard its counts and its first
    documents' raw files (what the card's drill-down shows, from the lineage record alone)."""
    tok = load_tokenizer(tokenizer_dir)
    packer = Packer(out, token_type(tok.get_vocab_size()), cfg.shard_tokens)
    read = 0
    for row, tokens in encoded(tok, docs_dir, (0, 1)):
        packer.add(row["id"], row["source"], row["domain"], row["path"], tokens)
        read += 1
    return {"documents_in": read, **packer.close()}


def encoded(tok, docs_dir: Path, part: tuple[int, int]):
    """(document, its tokens) for record shard `part` of `docs_dir`, encoded a few MB of text at a time."""
    ttype = token_type(tok.get_vocab_size()).to_pandas_dtype()
    batch: list[dict] = []
    chars = 0
    rows = iter_docs(docs_dir, shard=part)
    total = count_docs(docs_dir, part)
    for row in tqdm(rows, total=total, desc=f"tokenize {part[0]}/{part[1]}", unit="doc", mininterval=5):
        batch.append(row)
        chars += len(row["text"])
        if chars >= BATCH_CHARS:
            yield from zip(batch, encode_docs(tok, [r["text"] for r in batch], ttype))
            batch, chars = [], 0
    yield from zip(batch, encode_docs(tok, [r["text"] for r in batch], ttype))


def encode_part(cfg: TokenizerConfig, inputs: dict, prior: dict, out: Path, part: tuple[int, int]) -> dict:
    """Phase `encode` of the sharded stage: record shard `part`'s documents and tokens, in order, in
    `tokens.arrow` (the join packs them into the store's shards)."""
    tok = _tokenizer(inputs["tokenizer"])
    ttype = token_type(tok.get_vocab_size())
    schema = PART_SCHEMA.append(pa.field("tokens", pa.large_list(ttype)))
    n = tokens = 0
    with pa.ipc.new_file(out / "tokens.arrow", schema, options=_ZSTD) as writer:
        rows: list[tuple[dict, np.ndarray]] = []
        for row, toks in encoded(tok, inputs["docs"].dir, part):
            rows.append((row, toks))
            n, tokens = n + 1, tokens + len(toks)
            if len(rows) == BATCH_ROWS:
                writer.write_table(_part_table(rows, schema))
                rows = []
        writer.write_table(_part_table(rows, schema))
    return {"documents": n, "tokens": tokens}


_LOADED: dict[str, object] = {}  # the last tokenizer a process loaded, by its artifact's content hash


def _tokenizer(artifact) -> object:
    """The tokenizer artifact's tokenizer, loaded once per process (a third of a second for GPT-2's): a worker
    running one part after another encodes with the same one."""
    if artifact.content_hash not in _LOADED:
        _LOADED.clear()
        _LOADED[artifact.content_hash] = load_tokenizer(artifact.dir)
    return _LOADED[artifact.content_hash]


def _part_table(rows: list[tuple[dict, np.ndarray]], schema: pa.Schema) -> pa.Table:
    columns = {k: [r[k if k != "doc_id" else "id"] for r, _ in rows] for k in PART_SCHEMA.names}
    return pa.table({**columns, "tokens": pa.array([t for _, t in rows], schema.field("tokens").type)},
                    schema=schema)


def merge(cfg: TokenizerConfig, prior: dict[str, list[Path]], out: Path) -> dict:
    """Pack the `encode` parts, in order, into the store's shards: the same bytes as one process makes.
    What the parts read is what they recorded (each part's manifest)."""
    packer, read = None, 0
    for part in prior["encode"]:
        read += json.loads((part / MANIFEST).read_text())["stats"]["documents"]
        with pa.memory_map(str(part / "tokens.arrow")) as src:
            reader = pa.ipc.open_file(src)
            if packer is None:
                packer = Packer(out, reader.schema.field("tokens").type.value_type, cfg.shard_tokens)
            for b in range(reader.num_record_batches):
                batch = reader.get_batch(b)
                toks = batch.column("tokens")
                columns = (batch.column(k).to_pylist() for k in PART_SCHEMA.names)
                for i, (doc_id, source, domain, path) in enumerate(zip(*columns)):
                    packer.add(doc_id, source, domain, path, toks[i].values.to_numpy())
    return {"documents_in": read, **packer.close(), "parts": len(prior["encode"])}


class Packer:
    """Writes documents' tokens, in the order given, into zstd Arrow shards of about `shard_tokens` tokens
    each, in record batches of `BATCH_ROWS` documents (so a store's bytes do not depend on how its
    documents arrived), and streams `index.parquet`. Holds one batch, and per shard its counts."""

    def __init__(self, out: Path, ttype: pa.DataType, shard_tokens: int, sample_rows: int = 3):
        self.out, self.ttype, self.shard_tokens = Path(out), ttype, shard_tokens
        self.sample_rows = sample_rows
        self.schema = pa.schema([("doc_id", pa.string()), ("source", pa.string()), ("domain", pa.string()),
                                 ("tokens", pa.large_list(ttype))])
        self.index = pq.ParquetWriter(self.out / INDEX, INDEX_SCHEMA)
        self.rows: list[tuple] = []
        self.writer = None
        self.shards: list[dict] = []
        self.per_domain: dict[str, int] = {}
        self.in_shard = 0  # tokens in the open shard

    def add(self, doc_id: str, source: str, domain: str, path: str, tokens: np.ndarray) -> None:
        if self.writer is None:
            self.writer = pa.ipc.new_file(self.out / f"shard-{len(self.shards):05d}.arrow", self.schema,
                                          options=_ZSTD)
            self.shards.append({"shard": len(self.shards), "documents": 0, "tokens": 0, "sources": {},
                                "first_rows": []})
        s = self.shards[-1]
        if s["documents"] < self.sample_rows:
            s["first_rows"].append(
                {"row": s["documents"], "doc_id": doc_id, "tokens": len(tokens), "path": path})
        self.rows.append((doc_id, source, domain, s["shard"], s["documents"], tokens))
        s["documents"] += 1
        s["tokens"] += len(tokens)
        s["sources"][source] = s["sources"].get(source, 0) + 1
        self.per_domain[domain] = self.per_domain.get(domain, 0) + len(tokens)
        self.in_shard += len(tokens)
        if len(self.rows) == BATCH_ROWS or self.in_shard >= self.shard_tokens:
            self._flush()
        if self.in_shard >= self.shard_tokens:
            self.writer.close()
            self.writer, self.in_shard = None, 0

    def _flush(self) -> None:
        if not self.rows:
            return
        doc_ids, sources, domains, shards, rows, tokens = zip(*self.rows)
        names = {"doc_id": doc_ids, "source": sources, "domain": domains}
        self.writer.write_table(
            pa.table({**names, "tokens": pa.array(tokens, pa.large_list(self.ttype))}, self.schema))
        self.index.write_table(pa.table(
            {**names, "shard": shards, "row": rows, "tokens": [len(t) for t in tokens]}, INDEX_SCHEMA))
        self.rows = []

    def close(self) -> dict:
        self._flush()
        if self.writer is not None:
            self.writer.close()
        self.index.close()
        for s in self.shards:
            s["sources"] = dict(sorted(s["sources"].items()))
        return {
            "documents_out": sum(s["documents"] for s in self.shards),
            "tokens": sum(s["tokens"] for s in self.shards),
            "shards": len(self.shards),
            "tokens_per_domain": dict(sorted(self.per_domain.items())),
            "token_type": str(self.ttype),
            "by_shard": self.shards,
        }


def iter_tokens(store_dir: Path, ids: set[str] | None = None, rows: range | None = None):
    """(doc id, tokens) for every document of a store, or those in `ids`, or those at positions `rows` of
    the store's order, one record batch decompressed at a time: memory holds one batch and what the
    caller keeps, never the store. Shards wholly outside `rows` are skipped by their index counts."""
    starts = _shard_starts(store_dir) if rows is not None else None
    at = 0
    for k, shard in enumerate(sorted(Path(store_dir).glob("shard-*.arrow"))):
        if starts is not None:
            at = starts[k]
            if starts[k + 1] <= rows.start or at >= rows.stop:
                continue
        with pa.memory_map(str(shard)) as src:
            reader = pa.ipc.open_file(src)
            for b in range(reader.num_record_batches):
                batch = reader.get_batch(b)
                toks = batch.column("tokens")
                for i, doc_id in enumerate(batch.column("doc_id").to_pylist()):
                    if (ids is None or doc_id in ids) and (rows is None or at + i in rows):
                        yield doc_id, toks[i].values.to_numpy()
                at += batch.num_rows


def _shard_starts(store_dir: Path) -> np.ndarray:
    """The store position of each shard's first document (and the total, last)."""
    shard = pq.read_table(Path(store_dir) / INDEX, columns=["shard"]).column("shard").to_numpy()
    counts = np.bincount(shard) if shard.size else np.zeros(0, np.int64)
    return np.concatenate([[0], np.cumsum(counts)])


def read_tokens(store_dir: Path, ids: set[str] | None = None) -> dict[str, np.ndarray]:
    """doc id -> tokens, for the documents in `ids` (default: all, for small stores and tests)."""
    return dict(iter_tokens(store_dir, ids))
