"""Domain mixing: hold out evaluation documents, sample training documents by domain weight, pack sequences.

Held-out documents are chosen by a hash of their id (stable whatever else changes), at least one
per domain that has two or more documents. Training documents are drawn per domain in a seeded
order until the domain has its share of the token budget, repeating a domain's documents (epochs)
when it is too small; repetitions are recorded. The drawn documents are shuffled together and
packed, separated by the end-of-text token, into sequences of `seq_len + 1` tokens, which are shuffled
again so that no long document fills consecutive batches.
The run is a curriculum of phases (`mix.phases`), each with its own domain weights, budget in steps and
context length; a domain's documents are drawn in seeded permutations that carry on from phase to
phase, and repeating a domain more than `mix.max_epochs` times is a config error.
Outputs: `train.arrow` and `heldout.arrow` (uncompressed Arrow IPC in the stream format, memory-mapped
without a copy; the format `datasets` caches in, so `datasets.Dataset.from_file` opens them), each row one
sequence with the segments it holds: (doc_id, position in the sequence, offset in the document, length);
`train.arrow` also holds each row's phase (rows of different phases have different lengths), and
`heldout.arrow` each row's domain, at the last phase's context length.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import xxhash

from moeflow.configs import ConfigError, MixConfig, Phase
from moeflow.tokenize.store import read_tokens
from moeflow.tokenize.tokenizer import EOS
from moeflow.tokenize.tokenizer import load as load_tokenizer

SEGMENT = pa.struct(
    [("doc_id", pa.string()), ("start", pa.int32()), ("doc_offset", pa.int32()), ("length", pa.int32())]
)


def is_heldout(doc_id: str, fraction: float) -> bool:
    return xxhash.xxh3_64_intdigest(doc_id.encode()) % 1_000_000 < fraction * 1_000_000


def pack(
    docs: list[tuple[str, int, bool]], seq_len: int, max_sequences: int | None = None
) -> list[list[dict]]:
    """Pack (doc id, token count, complete) into rows of seq_len+1 tokens: each row's segments; a
    partial last row is dropped. Lengths only: `rows` fills them with tokens afterwards.

    A complete document is followed by EOS, which its segment covers at `doc_offset == length`;
    a document cut to the budget gets no EOS, since it does not end there.
    """
    width = seq_len + 1
    rows: list[list[dict]] = []
    fill, segs = 0, []
    for doc_id, length, complete in docs:
        length += 1 if complete else 0
        off = 0
        while off < length:
            take = min(width - fill, length - off)
            segs.append({"doc_id": doc_id, "start": fill, "doc_offset": off, "length": take})
            fill, off = fill + take, off + take
            if fill == width:
                rows.append(segs)
                fill, segs = 0, []
                if max_sequences is not None and len(rows) >= max_sequences:
                    return rows
    return rows


def rows(segments: list[list[dict]], tokens: dict[str, np.ndarray], eos: int) -> list[np.ndarray]:
    """The token rows that packed segments describe (a segment past a document's last token is its EOS)."""
    out = []
    for segs in segments:
        row = np.empty(sum(s["length"] for s in segs), dtype=np.int64)
        for s in segs:
            doc = tokens[s["doc_id"]]
            lo, hi = s["doc_offset"], s["doc_offset"] + s["length"]
            row[s["start"] : s["start"] + min(hi, len(doc)) - lo] = doc[lo:hi]
            if hi > len(doc):
                row[s["start"] + s["length"] - 1] = eos
        out.append(row)
    return out


def _write(
    path: Path, rows, segments, domains: list[str] | None, vocab_size: int, phases: list[int] | None = None
) -> None:
    """Rows of one width become a fixed-size list column; rows of several widths (phases) a list column."""
    ttype = pa.uint16() if vocab_size <= 65536 else pa.uint32()
    widths = {len(r) for r in rows}
    flat = pa.array(
        (np.concatenate(rows) if rows else np.empty(0, dtype=np.int64)).astype(ttype.to_pandas_dtype())
    )
    if len(widths) <= 1:
        tokens = pa.FixedSizeListArray.from_arrays(flat, widths.pop() if widths else 0)
    else:
        tokens = pa.ListArray.from_arrays(
            pa.array(np.concatenate([[0], np.cumsum([len(r) for r in rows])]), pa.int32()), flat
        )
    cols = {"tokens": tokens, "segments": pa.array(segments, type=pa.list_(SEGMENT))}
    if domains is not None:
        cols["domain"] = pa.array(domains, type=pa.string())
    if phases is not None:
        cols["phase"] = pa.array(phases, type=pa.int16())
    table = pa.table(cols)
    with pa.ipc.new_stream(path, table.schema) as w:
        w.write_table(table)


class _Domain:
    """A domain's training documents, drawn in seeded permutations that carry on across phases."""

    def __init__(self, ids: list[str], rng: np.random.Generator):
        self.ids, self.rng = ids, rng
        self.order: list[int] = []
        self.epochs = 0

    def next(self) -> str:
        if not self.order:
            self.order = list(self.rng.permutation(len(self.ids))[::-1])
            self.epochs += 1
        return self.ids[self.order.pop()]


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
) -> dict:
    """Write `train.arrow` (every phase's sequences in training order) and `heldout.arrow` (at the last
    phase's context length); raise ConfigError when a phase needs more repetition than `max_epochs`."""
    import pyarrow.parquet as pq

    tok = load_tokenizer(tokenizer_dir)
    eos, vocab = tok.token_to_id(EOS), tok.get_vocab_size()
    index = pq.read_table(Path(store_dir) / "index.parquet").to_pylist()
    length = {
        r["doc_id"]: r["tokens"] for r in index
    }  # sampling and packing need lengths; tokens are read last
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
    domains = {d: _Domain(ids, rng) for d, ids in sorted(train.items()) if ids}
    domain_tokens = {d: sum(length[i] + 1 for i in ids) for d, ids in train.items()}
    all_segments, phase_col, plan = [], [], []
    for ph in phases:
        num_sequences = ph.steps * batch_size
        budget = num_sequences * (ph.seq_len + 1)
        total_w = sum(w for w in ph.weights.values() if w > 0)
        drawn: list[tuple[str, int, bool]] = []
        targets = {}
        for domain, weight in sorted(ph.weights.items()):
            if weight <= 0 or domain not in domains:
                continue
            target = targets[domain] = int(budget * weight / total_w) + 1
            got, source = 0, domains[domain]
            while got < target:
                doc_id = source.next()
                take = min(length[doc_id], target - got)  # the last document may be cut to the budget
                drawn.append((doc_id, take, take == length[doc_id]))
                got += take + 1
            if source.epochs > cfg.max_epochs:
                field = f"mix.phases.{ph.index}" if cfg.phases else "mix.weights"
                raise ConfigError(
                    f"{field}: phase {ph.name!r} needs domain {domain!r} repeated {source.epochs} times "
                    f"(it holds {domain_tokens[domain]:,} training tokens), over mix.max_epochs = "
                    f"{cfg.max_epochs:g}; lower its weight or the phase's budget, or raise mix.max_epochs"
                )
        order = rng.permutation(len(drawn))
        segments = pack([drawn[i] for i in order], ph.seq_len, max_sequences=num_sequences)
        if len(segments) < num_sequences:
            raise ValueError(
                f"mix: phase {ph.name!r} packed only {len(segments)} of {num_sequences} sequences"
            )
        # Shuffle the packed sequences too: a long document (a play is ~400 sequences) would otherwise
        # fill many consecutive batches, and the loss would swing with whatever document is current.
        perm = rng.permutation(len(segments))
        all_segments += [segments[i] for i in perm]
        phase_col += [ph.index] * len(segments)
        plan.append(
            {
                "name": ph.name,
                "start_step": ph.start_step,
                "steps": ph.steps,
                "seq_len": ph.seq_len,
                "sequences": len(segments),
                "tokens": len(segments) * (ph.seq_len + 1),
                "weights": ph.weights,
                "target_tokens": targets,
                "tokens_per_domain": _per_domain([segments[i] for i in perm], index),
                "epochs_after": {d: s.epochs for d, s in domains.items() if s.epochs},
            }
        )
    last = phases[-1].seq_len
    ho_segs, ho_domains = [], []
    for domain, ids in sorted(heldout.items()):
        s = pack([(d, length[d], True) for d in sorted(ids)], last)
        ho_segs += s
        ho_domains += [domain] * len(s)
    # one pass over the store for the documents the mix uses: memory holds them and the output rows
    tokens = read_tokens(store_dir, ids={seg["doc_id"] for segs in all_segments + ho_segs for seg in segs})
    _write(out / "train.arrow", rows(all_segments, tokens, eos), all_segments, None, vocab, phases=phase_col)
    _write(out / "heldout.arrow", rows(ho_segs, tokens, eos), ho_segs, ho_domains, vocab)
    per_domain = _per_domain(all_segments, index)
    return {
        "seed": seed,
        "batch_size": batch_size,
        "seq_len": last,
        "train_sequences": len(all_segments),
        "train_tokens": sum(p["tokens"] for p in plan),
        "train_tokens_per_domain": per_domain,
        "phases": plan,
        "plan": {
            d: {
                "documents": len(train[d]),
                "training_tokens_available": domain_tokens[d],
                "epochs": s.epochs,
                "tokens": per_domain.get(d, 0),
            }
            for d, s in domains.items()
        },
        "heldout_documents": {d: len(v) for d, v in sorted(heldout.items())},
        "heldout_sequences": {d: ho_domains.count(d) for d in sorted(heldout)},
        "heldout_doc_ids": {d: sorted(v) for d, v in sorted(heldout.items())},
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
