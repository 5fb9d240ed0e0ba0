"""Sharded Arrow token stores: one row per document (id, source, domain, tokens) in zstd Arrow IPC shards.

`index.parquet` maps every document to its shard, row and token count, so any token traces back to
its document and raw source. Long documents are cut at line breaks before encoding (one very long
document slows `encode_batch` for the whole batch); the pieces' tokens are concatenated.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from moeflow.configs import TokenizerConfig
from moeflow.documents import count_docs, iter_docs
from moeflow.tokenize.tokenizer import load as load_tokenizer

INDEX = "index.parquet"
PIECE_CHARS = 16_384
BATCH_CHARS = 4_000_000  # text per encode_batch call: large enough to keep every core busy


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


def encode_docs(tokenizer, texts: list[str]) -> list[np.ndarray]:
    flat, owner = [], []
    for i, text in enumerate(texts):
        for p in pieces(text):
            flat.append(p)
            owner.append(i)
    encs = tokenizer.encode_batch(flat, add_special_tokens=False)
    out: list[list[int]] = [[] for _ in texts]
    for i, enc in zip(owner, encs):
        out[i].extend(enc.ids)
    return [np.asarray(ids, dtype=np.int64) for ids in out]


def stage(cfg: TokenizerConfig, inputs: dict, out: Path) -> dict:
    """The `tokenize` stage's body: its `docs` input encoded with its `tokenizer` input."""
    return run(cfg, inputs["docs"].dir, inputs["tokenizer"].dir, out)


def run(cfg: TokenizerConfig, docs_dir: Path, tokenizer_dir: Path, out: Path, sample_rows: int = 3) -> dict:
    """Write the shards and `index.parquet` into `out`; return stats, with per shard its counts and its first
    `sample_rows` documents' raw files (what the card's drill-down shows, from the lineage record alone)."""
    tok = load_tokenizer(tokenizer_dir)
    ttype = token_type(tok.get_vocab_size())
    schema = pa.schema([("doc_id", pa.string()), ("source", pa.string()), ("domain", pa.string()),
                        ("tokens", pa.large_list(ttype))])
    index = {"doc_id": [], "source": [], "domain": [], "shard": [], "row": [], "tokens": []}
    shard_no, rows_in_shard, tokens_in_shard, writer = 0, 0, 0, None
    per_domain: dict[str, int] = {}
    paths: dict[tuple[int, int], str] = {}  # (shard, row) -> raw file, for each shard's first rows
    total = count_docs(docs_dir)
    batch: list[dict] = []
    batch_chars = 0

    pending: list[tuple[dict, np.ndarray]] = []  # documents of the open shard not yet written

    def write_pending() -> None:
        nonlocal writer
        if not pending:
            return
        if writer is None:
            writer = pa.ipc.new_file(out / f"shard-{shard_no:05d}.arrow", schema,
                                     options=pa.ipc.IpcWriteOptions(compression="zstd"))
        writer.write_table(
            pa.table(
                {
                    "doc_id": [r["id"] for r, _ in pending],
                    "source": [r["source"] for r, _ in pending],
                    "domain": [r["domain"] for r, _ in pending],
                    "tokens": pa.array([t for _, t in pending], type=pa.large_list(ttype)),
                },
                schema=schema,
            )
        )
        pending.clear()

    def flush(batch: list[dict]) -> None:
        nonlocal shard_no, rows_in_shard, tokens_in_shard, writer
        for r, toks in zip(batch, encode_docs(tok, [r["text"] for r in batch])):
            pending.append((r, toks))
            for k, v in (
                ("doc_id", r["id"]),
                ("source", r["source"]),
                ("domain", r["domain"]),
                ("shard", shard_no),
                ("row", rows_in_shard),
                ("tokens", len(toks)),
            ):
                index[k].append(v)
            per_domain[r["domain"]] = per_domain.get(r["domain"], 0) + len(toks)
            if rows_in_shard < sample_rows:
                paths[(shard_no, rows_in_shard)] = r["path"]
            rows_in_shard += 1
            tokens_in_shard += len(toks)
            if tokens_in_shard >= cfg.shard_tokens:
                write_pending()
                writer.close()
                writer, shard_no, rows_in_shard, tokens_in_shard = None, shard_no + 1, 0, 0
        write_pending()

    for row in tqdm(iter_docs(docs_dir), total=total, desc="tokenize", unit="doc", mininterval=5):
        batch.append(row)
        batch_chars += len(row["text"])
        if batch_chars >= BATCH_CHARS:
            flush(batch)
            batch, batch_chars = [], 0
    if batch:
        flush(batch)
    if writer is not None:
        writer.close()
        shard_no += 1
    pq.write_table(pa.table(index), out / INDEX)
    return {
        "documents": len(index["doc_id"]),
        "tokens": int(sum(index["tokens"])),
        "shards": shard_no,
        "tokens_per_domain": dict(sorted(per_domain.items())),
        "token_type": str(ttype),
        "by_shard": _by_shard(index, paths),
    }


def _by_shard(index: dict[str, list], paths: dict[tuple[int, int], str]) -> list[dict]:
    """Per shard: documents, tokens, documents per source, and the rows in `paths` with their raw file."""
    shards: list[dict] = []
    columns = (index[k] for k in ("doc_id", "source", "shard", "row", "tokens"))
    for doc_id, source, shard, row, tokens in zip(*columns):
        if shard == len(shards):
            shards.append({"shard": shard, "documents": 0, "tokens": 0, "sources": {}, "first_rows": []})
        s = shards[shard]
        s["documents"] += 1
        s["tokens"] += tokens
        s["sources"][source] = s["sources"].get(source, 0) + 1
        if (shard, row) in paths:
            s["first_rows"].append(
                {"row": row, "doc_id": doc_id, "tokens": tokens, "path": paths[shard, row]}
            )
    for s in shards:
        s["sources"] = dict(sorted(s["sources"].items()))
    return shards


def iter_tokens(store_dir: Path, ids: set[str] | None = None):
    """(doc id, tokens) for every document of a store, or those in `ids`, one record batch decompressed
    at a time: memory holds one batch and what the caller keeps, never the store."""
    for shard in sorted(Path(store_dir).glob("shard-*.arrow")):
        with pa.memory_map(str(shard)) as src:
            reader = pa.ipc.open_file(src)
            for b in range(reader.num_record_batches):
                batch = reader.get_batch(b)
                toks = batch.column("tokens")
                for i, doc_id in enumerate(batch.column("doc_id").to_pylist()):
                    if ids is None or doc_id in ids:
                        yield doc_id, toks[i].values.to_numpy()


def read_tokens(store_dir: Path, ids: set[str] | None = None) -> dict[str, np.ndarray]:
    """doc id -> tokens, for the documents in `ids` (default: all, for small stores and tests)."""
    return dict(iter_tokens(store_dir, ids))
