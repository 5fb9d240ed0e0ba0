"""Domain mixing: hold out evaluation documents, sample training documents by domain weight, pack sequences.

Held-out documents are chosen by group (`tokenize.heldout`: every version of a work on one side), and
their overlap with the training documents is measured (`leakage.json`). Training documents (or, with
`mix.piece_tokens`, pieces of them) are drawn per domain in a seeded order until the domain has its share
of the token budget, repeating a domain's documents (epochs) when it is too small; repetitions are recorded.
The drawn pieces are shuffled together and packed, separated by the end-of-text token where a document
ends, into sequences of `seq_len + 1` tokens, which are shuffled again so that no long document fills
consecutive batches. Every draw is a common random number: each domain draws its pieces, and their places in
the shuffle, from streams of its own, and a sequence's place is a hash of the text at its middle. Two mixes
at one seed then train on the same pieces, in nearly the same order, but for what their weights change, so
comparing them (a mixture search's proxies, or targets) measures the weights, not a reshuffle.
The run is a curriculum of phases (`mix.phases`), each with its own domain weights, budget in steps and
context length; a domain's documents are drawn in seeded permutations that carry on from phase to
phase, and repeating a domain more than `mix.max_epochs` times is a config error.
Outputs: `train.arrow` and `heldout.arrow` (uncompressed Arrow IPC in the stream format, memory-mapped
without a copy; the format `datasets` caches in, so `datasets.Dataset.from_file` opens them), each row one
sequence with the segments it holds: (doc_id, position in the sequence, offset in the document, length);
`train.arrow` also holds each row's phase (rows of different phases have different lengths), and
`heldout.arrow` each row's domain, at the last phase's context length, each domain's documents in id order.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from moeflow.configs import ConfigError, MixConfig, Phase
from moeflow.quality import buckets
from moeflow.tokenize import heldout as heldout_split
from moeflow.tokenize.store import iter_tokens
from moeflow.tokenize.tokenizer import EOS
from moeflow.tokenize.tokenizer import load as load_tokenizer

LEAKAGE = "leakage.json"  # the held-out documents' overlap with training documents
BATCH_ROWS = 1024  # sequences per record batch of a mix file
SEGMENT = pa.struct(
    [("doc_id", pa.string()), ("start", pa.int32()), ("doc_offset", pa.int32()), ("length", pa.int32())]
)


Piece = tuple[str, int, int, bool]  # (doc id, offset, tokens, whether it ends its document: EOS follows)


def pack(docs: list[Piece], seq_len: int, max_sequences: int | None = None) -> list[list[dict]]:
    """Pack pieces of documents into rows of seq_len+1 tokens: each row's segments; a partial last row is
    dropped. Lengths only: `rows` fills them with tokens afterwards.

    A piece that ends its document is followed by EOS, which its segment covers at the document's
    length; a piece cut to the budget, or a piece that ends before its document does, gets no EOS.
    """
    width = seq_len + 1
    rows: list[list[dict]] = []
    fill, segs = 0, []
    for doc_id, off, length, ends in docs:
        end = off + length + (1 if ends else 0)
        while off < end:
            take = min(width - fill, end - off)
            segs.append({"doc_id": doc_id, "start": fill, "doc_offset": off, "length": take})
            fill, off = fill + take, off + take
            if fill == width:
                rows.append(segs)
                fill, segs = 0, []
                if max_sequences is not None and len(rows) >= max_sequences:
                    return rows
    return rows


def _fill(segments: list[list[dict]], store_dir: Path, eos: int, dtype, path: Path) -> tuple[np.ndarray, ...]:
    """The tokens that packed segments describe, in a file-backed array at `path` (a segment past a
    document's last token is its EOS), and each row's start in it. The store is read once, a record batch
    at a time, each document's tokens scattered to every place its segments name: memory holds the plan,
    not the tokens."""
    widths = np.fromiter((sum(s["length"] for s in segs) for segs in segments), np.int64, len(segments))
    starts = np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)
    flat = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(int(starts[-1]),))
    wants: dict[str, list[tuple[int, int, int]]] = {}  # doc id -> (place in flat, offset in doc, length)
    for r, segs in enumerate(segments):
        for s in segs:
            place = (int(starts[r]) + s["start"], s["doc_offset"], s["length"])
            wants.setdefault(s["doc_id"], []).append(place)
    for doc_id, doc in iter_tokens(store_dir, set(wants)):
        for at, lo, n in wants[doc_id]:
            have = max(0, min(n, len(doc) - lo))
            flat[at : at + have] = doc[lo : lo + have]
            if have < n:
                flat[at + n - 1] = eos
    return flat, starts


def _write(path: Path, segments: list[list[dict]], flat: np.ndarray, starts: np.ndarray, ttype: pa.DataType,
           domains: list[str] | None = None, phases: list[int] | None = None) -> None:
    """Write a mix file in record batches of `BATCH_ROWS` sequences (row i's tokens: `flat[starts[i]:
    starts[i + 1]]`): rows of one width as a fixed-size list column, of several (phases) as a list column."""
    widths = set(np.diff(starts).tolist())
    fixed = (widths.pop() if widths else 0) if len(widths) <= 1 else None
    cols = [("tokens", pa.list_(ttype, fixed) if fixed is not None else pa.list_(ttype)),
            ("segments", pa.list_(SEGMENT))]
    cols += [("domain", pa.string())] if domains is not None else []
    cols += [("phase", pa.int16())] if phases is not None else []
    schema = pa.schema(cols)
    with pa.ipc.new_stream(path, schema) as w:
        for lo in range(0, max(len(segments), 1), BATCH_ROWS):
            hi = min(len(segments), lo + BATCH_ROWS)
            values = pa.array(flat[starts[lo] : starts[hi]], ttype)
            if fixed is not None:
                tokens = pa.FixedSizeListArray.from_arrays(values, fixed)
            else:
                offsets = pa.array(starts[lo : hi + 1] - starts[lo], pa.int32())
                tokens = pa.ListArray.from_arrays(offsets, values)
            batch = [tokens, pa.array(segments[lo:hi], type=pa.list_(SEGMENT))]
            batch += [pa.array(domains[lo:hi], pa.string())] if domains is not None else []
            batch += [pa.array(phases[lo:hi], pa.int16())] if phases is not None else []
            w.write_batch(pa.record_batch(batch, schema=schema))


def write_rows(path: Path, rows: list[np.ndarray], segments: list[list[dict]], vocab_size: int,
               domains: list[str] | None = None, phases: list[int] | None = None) -> None:
    """A mix file from token rows in memory (small files: tests, tools)."""
    ttype = pa.uint16() if vocab_size <= 65536 else pa.uint32()
    flat = np.concatenate(rows) if rows else np.empty(0, np.int64)
    starts = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    _write(path, segments, flat.astype(ttype.to_pandas_dtype()), starts, ttype, domains, phases)


def _write_all(out: Path, store_dir: Path, eos: int, vocab_size: int, train: list[list[dict]],
               phases: list[int], heldout: list[list[dict]], domains: list[str]) -> None:
    """`train.arrow` and `heldout.arrow`, their tokens gathered in one pass over the store into a
    file-backed array that is deleted after."""
    ttype = pa.uint16() if vocab_size <= 65536 else pa.uint32()
    scratch = out / ".tokens.npy"
    flat, starts = _fill(train + heldout, store_dir, eos, ttype.to_pandas_dtype(), scratch)
    n = len(train)
    _write(out / "train.arrow", train, flat, starts[: n + 1], ttype, phases=phases)
    _write(out / "heldout.arrow", heldout, flat, starts[n:], ttype, domains=domains)
    del flat
    scratch.unlink()


def _stream(seed: int, *names: object) -> np.random.Generator:
    """The run seed's random stream named `names`: its draws do not depend on what any other stream drew."""
    return np.random.default_rng([seed, *(zlib.crc32(str(n).encode()) for n in names)])


class _Domain:
    """A domain's training text, drawn in seeded permutations that carry on across phases: whole documents,
    or with `piece` each document cut into equal pieces of at most `piece` tokens, drawn apart. Each piece
    drawn comes with a key, its place in the phase's shuffle. Both come from the domain's own streams, so a
    mix that draws more of a domain draws the same pieces first, with the same keys (common random numbers:
    two mixes' runs differ by their weights, not by a reshuffle)."""

    def __init__(self, name: str, ids: list[str], seed: int, length: dict[str, int], piece: int | None):
        self.pieces = [p for i in ids for p in _pieces(i, length[i], piece)]
        self.rng, self.keys = _stream(seed, "draw", name), _stream(seed, "order", name)
        self.order: list[int] = []
        self.epochs = 0

    def next(self) -> tuple[Piece, float]:
        """The next piece and its key."""
        if not self.order:
            self.order = list(self.rng.permutation(len(self.pieces))[::-1])
            self.epochs += 1
        return self.pieces[self.order.pop()], float(self.keys.random())


def _pieces(doc_id: str, n: int, piece: int | None) -> list[Piece]:
    """A document of `n` tokens as pieces of at most `piece` tokens, as even as whole tokens allow (none: the
    whole document)."""
    k = -(-n // piece) if piece else 1
    cuts = [n * j // k for j in range(k + 1)]
    return [(doc_id, cuts[j], cuts[j + 1] - cuts[j], j == k - 1) for j in range(k)]


def stage(s: dict, inputs: dict, out: Path) -> dict:
    """The `mix` (and `rung_mix`) stage's body: `s` holds mix, seed, batch_size and the resolved phases."""
    return run(
        s["mix"],
        seed=s["seed"],
        phases=s["phases"],
        batch_size=s["batch_size"],
        store_dir=inputs["shards"].dir,
        tokenizer_dir=inputs["tokenizer"].dir,
        out=out,
        leakage=s["leakage"],
        scores=buckets.read_scores(inputs["quality"].dir) if "quality" in inputs else None,
    )


def run(
    cfg: MixConfig,
    *,
    seed: int,
    phases: list[Phase],
    batch_size: int,
    store_dir: Path,
    tokenizer_dir: Path,
    out: Path,
    leakage: bool = True,
    scores: dict[str, float] | None = None,
) -> dict:
    """Write `train.arrow` (every phase's sequences in training order) and `heldout.arrow` (at the last
    phase's context length) and, with `leakage`, `leakage.json` (`tokenize.heldout.leakage`); raise
    ConfigError when a phase needs more repetition than `max_epochs`. With `mix.quality_buckets`, each
    domain's training documents are drawn in buckets by their `scores` (`quality/buckets.py`)."""
    tok = load_tokenizer(tokenizer_dir)
    eos, vocab = tok.token_to_id(EOS), tok.get_vocab_size()
    index = pq.read_table(Path(store_dir) / "index.parquet").to_pylist()
    length = {r["doc_id"]: r["tokens"] for r in index}  # sampling and packing need lengths; tokens are read last
    train, heldout = heldout_split.split(_by_domain(index, phases), cfg.heldout)
    train, phases, bucket_of = buckets.split(cfg, train, scores, length, phases)
    labelled = [{**r, "domain": bucket_of.get(r["doc_id"], r["domain"])} for r in index] if bucket_of else index
    domains = {d: _Domain(d, ids, seed, length, cfg.piece_tokens) for d, ids in sorted(train.items()) if ids}
    domain_tokens = {d: sum(length[i] + 1 for i in ids) for d, ids in train.items()}
    all_segments, phase_col, plan = [], [], []
    for ph in phases:
        drawn, targets = _draw(cfg, ph, ph.steps * batch_size * (ph.seq_len + 1), domains, domain_tokens)
        segments = _packed(ph, drawn, ph.steps * batch_size, seed)
        all_segments += segments
        phase_col += [ph.index] * len(segments)
        plan.append(_phase_record(ph, segments, targets, labelled, domains))
    last = phases[-1].seq_len
    ho_segs, ho_domains = _heldout_rows(heldout, length, last)
    _write_all(out, store_dir, eos, vocab, all_segments, phase_col, ho_segs, ho_domains)
    leaks = heldout_split.leakage(store_dir, tok, train, heldout, cfg.heldout) if leakage else None
    if leaks is not None:
        (out / LEAKAGE).write_text(json.dumps(leaks, indent=1))
    per_domain, per_label = _per_domain(all_segments, index), _per_domain(all_segments, labelled)
    return {
        "documents_in": len(index),
        "seed": seed,
        "batch_size": batch_size,
        "seq_len": last,
        "train_sequences": len(all_segments),
        "train_tokens": sum(p["tokens"] for p in plan),
        "train_tokens_per_domain": per_domain,
        "phases": plan,
        "plan": {d: {"documents": len(train[d]), "training_tokens_available": domain_tokens[d],
                     "epochs": s.epochs, "tokens": per_label.get(d, 0)} for d, s in domains.items()},
        "heldout_documents": {d: len(v) for d, v in sorted(heldout.items())},
        "heldout_sequences": {d: ho_domains.count(d) for d in sorted(heldout)},
        "heldout_doc_ids": {d: sorted(v) for d, v in sorted(heldout.items())},
        **({"heldout_leakage": heldout_split.summary(leaks, cfg.heldout)} if leaks is not None else {}),
    }


def _heldout_rows(heldout: dict[str, list[str]], length: dict[str, int], seq_len: int) -> tuple[list, list]:
    """Each domain's held-out documents packed at `seq_len`, in id order: (segments, domain) per row."""
    segs, domains = [], []
    for domain, ids in sorted(heldout.items()):
        s = pack([(d, 0, length[d], True) for d in sorted(ids)], seq_len)
        segs += s
        domains += [domain] * len(s)
    return segs, domains


def _by_domain(index: list[dict], phases: list[Phase]) -> dict[str, list[str]]:
    """Domain -> ids of its documents with tokens; a phase asking for a domain with none is an error."""
    by_domain: dict[str, list[str]] = {}
    for r in index:
        if r["tokens"] > 0:
            by_domain.setdefault(r["domain"], []).append(r["doc_id"])
    for ph in phases:
        missing = sorted(d for d, w in ph.weights.items() if w > 0 and d not in by_domain)
        if missing:
            raise ConfigError(
                f"mix: phase {ph.name!r} asks for domains {missing}, but no document of them survived "
                "the data stages"
            )
    return by_domain


def _draw(cfg: MixConfig, ph: Phase, budget: int, domains: dict[str, _Domain],
          domain_tokens: dict[str, int]) -> tuple[list[tuple[Piece, float]], dict[str, int]]:
    """The pieces a phase samples, by domain weight, up to its token budget, each with its key: (drawn, target
    per domain)."""
    total_w = sum(w for w in ph.weights.values() if w > 0)
    drawn: list[tuple[Piece, float]] = []
    targets = {}
    for domain, weight in sorted(ph.weights.items()):
        if weight <= 0 or domain not in domains:
            continue
        target = targets[domain] = int(budget * weight / total_w) + 1
        got, source = 0, domains[domain]
        while got < target:
            (doc_id, offset, n, last), key = source.next()
            take = min(n, target - got)  # the last piece may be cut to the budget
            drawn.append(((doc_id, offset, take, last and take == n), key))
            got += take + last  # a document's last piece is followed by EOS (budgeted even when cut)
        if source.epochs > cfg.max_epochs:
            field = f"mix.phases.{ph.index}" if cfg.phases else "mix.weights"
            raise ConfigError(
                f"{field}: phase {ph.name!r} needs domain {domain!r} repeated {source.epochs} times "
                f"(it holds {domain_tokens[domain]:,} training tokens), over mix.max_epochs = "
                f"{cfg.max_epochs:g}; lower its weight or the phase's budget, or raise mix.max_epochs"
            )
    return drawn, targets


def _packed(ph: Phase, drawn: list[tuple[Piece, float]], num_sequences: int, seed: int) -> list[list[dict]]:
    """The phase's drawn documents shuffled (in the order of their keys), packed into `num_sequences`
    sequences, shuffled again (in the order of `_row_key`)."""
    segments = pack([p for p, _ in sorted(drawn, key=lambda x: x[1])], ph.seq_len, max_sequences=num_sequences)
    if len(segments) < num_sequences:
        raise ValueError(f"mix: phase {ph.name!r} packed only {len(segments)} of {num_sequences} sequences")
    # Shuffle the packed sequences too: a long document (a play is ~400 sequences) would otherwise
    # fill many consecutive batches, and the loss would swing with whatever document is current.
    return sorted(segments, key=lambda segs: _row_key(segs, ph, seed))


def _row_key(segs: list[dict], ph: Phase, seed: int) -> int:
    """A sequence's place in the phase's shuffle: a hash of the stretch of `seq_len + 1` tokens of its document
    that holds its middle token. Another mix that packs the same text at another alignment puts its sequence
    with the same middle stretch (at least half the same tokens) in the same place, before other keys."""
    width = ph.seq_len + 1
    mid = width // 2
    s = next(s for s in segs if s["start"] <= mid < s["start"] + s["length"])
    block = (s["doc_offset"] + mid - s["start"]) // width
    return xxhash.xxh3_64_intdigest(f"{seed}/{ph.index}/{s['doc_id']}/{block}".encode())


def _phase_record(ph: Phase, segments: list[list[dict]], targets: dict[str, int], index: list[dict],
                  domains: dict[str, _Domain]) -> dict:
    return {
        "name": ph.name,
        "start_step": ph.start_step,
        "steps": ph.steps,
        "seq_len": ph.seq_len,
        "sequences": len(segments),
        "tokens": len(segments) * (ph.seq_len + 1),
        "weights": ph.weights,
        "target_tokens": targets,
        "tokens_per_domain": _per_domain(segments, index),
        "epochs_after": {d: s.epochs for d, s in domains.items() if s.epochs},
    }


def _per_domain(segments: list[list[dict]], index: list[dict]) -> dict[str, int]:
    domain_of = {r["doc_id"]: r["domain"] for r in index}
    out: dict[str, int] = {}
    for segs in segments:
        for s in segs:
            out[domain_of[s["doc_id"]]] = out.get(domain_of[s["doc_id"]], 0) + s["length"]
    return dict(sorted(out.items()))


def read(path: Path) -> pa.Table:
    with pa.memory_map(str(path)) as src:
        return pa.ipc.open_stream(src).read_all()


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
