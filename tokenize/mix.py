"""Domain mixing: hold out documents for evaluation, sample training documents by domain weight, pack sequences.

Held-out documents are chosen by a hash of their id (stable whatever else changes), at least one
per domain that has two or more documents. Training documents are drawn per domain in a seeded
order until the domain has its share of the token budget, repeating a domain's documents (epochs)
when it is too small; repetitions are recorded. The drawn documents are shuffled together and
packed, separated by the end-of-text token, into sequences of `seq_len + 1` tokens, which are shuffled
again so that no long document fills consecutive batches.
Outputs: `train.arrow` and `heldout.arrow` (uncompressed Arrow IPC, memory-mappable), each row one
sequence with the segments it holds: (doc_id, position in the sequence, offset in the document, length).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import xxhash

from moeflow.configs import MixConfig
from moeflow.tokenize.store import read_tokens
from moeflow.tokenize.tokenizer import EOS
from moeflow.tokenize.tokenizer import load as load_tokenizer

VERSION = 3
SEGMENT = pa.struct([("doc_id", pa.string()), ("start", pa.int32()), ("doc_offset", pa.int32()), ("length", pa.int32())])


def is_heldout(doc_id: str, fraction: float) -> bool:
    return xxhash.xxh3_64_intdigest(doc_id.encode()) % 1_000_000 < fraction * 1_000_000


def pack(docs: list[tuple[str, np.ndarray, bool]], seq_len: int, eos: int, max_sequences: int | None = None):
    """Pack (doc id, tokens, complete) into rows of seq_len+1 tokens; a partial last row is dropped.

    A complete document is followed by EOS, which its segment covers at `doc_offset == len(tokens)`;
    a document cut to the budget gets no EOS, since it does not end there.
    """
    width = seq_len + 1
    rows, segments = [], []
    buf = np.empty(width, dtype=np.int64)
    fill, segs = 0, []
    for doc_id, toks, complete in docs:
        toks = np.append(toks, eos) if complete else toks
        off = 0
        while off < len(toks):
            take = min(width - fill, len(toks) - off)
            buf[fill : fill + take] = toks[off : off + take]
            segs.append({"doc_id": doc_id, "start": fill, "doc_offset": off, "length": take})
            fill, off = fill + take, off + take
            if fill == width:
                rows.append(buf.copy())
                segments.append(segs)
                buf, fill, segs = np.empty(width, dtype=np.int64), 0, []
                if max_sequences is not None and len(rows) >= max_sequences:
                    return rows, segments
    return rows, segments


def _write(path: Path, rows, segments, domains: list[str] | None, vocab_size: int) -> None:
    ttype = pa.uint16() if vocab_size <= 65536 else pa.uint32()
    width = len(rows[0]) if rows else 0
    flat = np.concatenate(rows) if rows else np.empty(0, dtype=np.int64)
    cols = {
        "tokens": pa.FixedSizeListArray.from_arrays(pa.array(flat.astype(ttype.to_pandas_dtype())), width),
        "segments": pa.array(segments, type=pa.list_(SEGMENT)),
    }
    if domains is not None:
        cols["domain"] = pa.array(domains, type=pa.string())
    table = pa.table(cols)
    with pa.ipc.new_file(path, table.schema) as w:
        w.write_table(table)


def run(cfg: MixConfig, *, seed: int, seq_len: int, num_sequences: int, store_dir: Path, tokenizer_dir: Path,
        out: Path) -> dict:
    import pyarrow.parquet as pq

    tok = load_tokenizer(tokenizer_dir)
    eos, vocab = tok.token_to_id(EOS), tok.get_vocab_size()
    index = pq.read_table(Path(store_dir) / "index.parquet").to_pylist()
    tokens = read_tokens(store_dir)
    by_domain: dict[str, list[str]] = {}
    for r in index:
        if r["tokens"] > 0:
            by_domain.setdefault(r["domain"], []).append(r["doc_id"])
    missing = sorted(d for d, w in cfg.weights.items() if w > 0 and d not in by_domain)
    if missing:
        raise ValueError(f"mix.weights asks for domains {missing}, but no document of them survived the data stages")
    heldout: dict[str, list[str]] = {}
    train: dict[str, list[str]] = {}
    for domain, ids in sorted(by_domain.items()):
        ho = [d for d in ids if is_heldout(d, cfg.heldout_fraction)]
        if not ho and len(ids) >= 2:
            ho = [min(ids, key=lambda d: xxhash.xxh3_64_intdigest(d.encode()))]
        heldout[domain] = ho
        held = set(ho)
        train[domain] = [d for d in ids if d not in held]

    rng = np.random.default_rng(seed)
    budget = num_sequences * (seq_len + 1)
    total_w = sum(w for d, w in cfg.weights.items() if w > 0)
    drawn: list[tuple[str, np.ndarray]] = []
    plan: dict[str, dict] = {}
    for domain, weight in sorted(cfg.weights.items()):
        if weight <= 0 or not train.get(domain):
            continue
        target = int(budget * weight / total_w) + 1
        ids = train[domain]
        got, epochs = 0, 0
        while got < target:
            epochs += 1
            for i in rng.permutation(len(ids)):
                doc_id = ids[i]
                full = tokens[doc_id]
                take = full[: target - got]  # the last document may be cut to the budget
                drawn.append((doc_id, take, len(take) == len(full)))
                got += len(take) + 1
                if got >= target:
                    break
        plan[domain] = {"weight": weight, "target_tokens": target, "tokens": got, "documents": len(ids), "epochs": epochs}
    order = rng.permutation(len(drawn))
    rows, segments = pack([drawn[i] for i in order], seq_len, eos, max_sequences=num_sequences)
    if len(rows) < num_sequences:
        raise ValueError(f"mix: packed only {len(rows)} of {num_sequences} sequences; the budget is too large")
    # Shuffle the packed sequences too: a long document (a play is ~400 sequences) would otherwise
    # fill many consecutive batches, and the loss would swing with whatever document is current.
    perm = rng.permutation(len(rows))
    rows, segments = [rows[i] for i in perm], [segments[i] for i in perm]
    _write(out / "train.arrow", rows, segments, None, vocab)

    ho_rows, ho_segs, ho_domains = [], [], []
    for domain, ids in sorted(heldout.items()):
        r, s = pack([(d, tokens[d], True) for d in sorted(ids)], seq_len, eos)
        ho_rows += r
        ho_segs += s
        ho_domains += [domain] * len(r)
    _write(out / "heldout.arrow", ho_rows, ho_segs, ho_domains, vocab)
    realised: dict[str, int] = {}
    for segs in segments:
        for s in segs:
            realised[s["doc_id"]] = realised.get(s["doc_id"], 0) + s["length"]
    domain_of = {r["doc_id"]: r["domain"] for r in index}
    per_domain: dict[str, int] = {}
    for doc_id, n in realised.items():
        per_domain[domain_of[doc_id]] = per_domain.get(domain_of[doc_id], 0) + n
    return {
        "seed": seed, "seq_len": seq_len, "train_sequences": len(rows), "train_tokens": len(rows) * (seq_len + 1),
        "train_tokens_per_domain": dict(sorted(per_domain.items())), "plan": plan,
        "heldout_documents": {d: len(v) for d, v in sorted(heldout.items())},
        "heldout_sequences": {d: ho_domains.count(d) for d in sorted(heldout)},
        "heldout_doc_ids": {d: sorted(v) for d, v in sorted(heldout.items())},
    }


def read(path: Path) -> pa.Table:
    with pa.memory_map(str(path)) as src:
        return pa.ipc.open_file(src).read_all()


def segments_of(path: Path, doc_id: str) -> list[dict]:
    """Where a document's tokens sit in a mix file: one dict per segment, with the sequence row."""
    segs = read(path).column("segments").to_pylist()
    return [{"row": row, **s} for row, seq in enumerate(segs) for s in seq if s["doc_id"] == doc_id]


def locate(path: Path, row: int, position: int) -> dict:
    """The document (and offset in it) of the token at `position` of sequence `row`; with batch size B,
    training step s, batch row b is sequence s * B + b."""
    for s in read(path).column("segments")[row].as_py():
        if s["start"] <= position < s["start"] + s["length"]:
            return {"doc_id": s["doc_id"], "doc_offset": s["doc_offset"] + position - s["start"]}
    raise IndexError(f"{path}: sequence {row} has no token at position {position}")
