"""The document ledger: one row per input document of a data stage with its fate, and conservation.

Fates: `kept`; `dropped` (reason = the filter's reason string); `duplicate` (detail = the
representative's id); `contaminated` (detail = benchmark and item); `quarantined` (reason = the
error). A stage fails unless its inputs equal the sum of its fates and its output holds exactly
the kept documents.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

FATES = ("kept", "dropped", "duplicate", "contaminated", "quarantined")
LEDGER = "ledger.parquet"
ROWS_PER_GROUP = 65_536  # fixed, so a ledger joined from any number of shards has the same bytes
SCHEMA = pa.schema(
    [("doc_id", pa.string()), ("fate", pa.string()), ("reason", pa.string()), ("detail", pa.string())]
)


class ConservationError(RuntimeError):
    """A stage lost or invented documents."""


class Ledger:
    def __init__(self, stage: str):
        self.stage = stage
        self.rows: dict[str, list] = {name: [] for name in SCHEMA.names}

    def add(self, doc_id: str, fate: str, reason: str = "", detail: str = "") -> None:
        if fate not in FATES:
            raise ValueError(f"unknown fate {fate!r}")
        self.rows["doc_id"].append(doc_id)
        self.rows["fate"].append(fate)
        self.rows["reason"].append(reason)
        self.rows["detail"].append(detail)

    def kept(self, doc_id: str) -> None:
        self.add(doc_id, "kept")

    def __len__(self) -> int:
        return len(self.rows["doc_id"])

    def counts(self) -> dict[str, int]:
        """Counts per fate, and per `fate:reason` for every fate that has reasons."""
        out = Counter(self.rows["fate"])
        for fate, reason in zip(self.rows["fate"], self.rows["reason"]):
            if reason:
                out[f"{fate}:{reason}"] += 1
        return dict(sorted(out.items()))

    def check(self, n_inputs: int, n_outputs: int) -> dict:
        """Enforce conservation; return the stats block that lineage records."""
        fates = Counter(self.rows["fate"])
        total = sum(fates.values())
        if total != n_inputs:
            raise ConservationError(
                f"stage {self.stage}: {n_inputs} input documents but the ledger accounts for {total} "
                f"({dict(fates)})"
            )
        if fates.get("kept", 0) != n_outputs:
            raise ConservationError(
                f"stage {self.stage}: ledger keeps {fates.get('kept', 0)} documents but the output holds "
                f"{n_outputs}"
            )
        dup = Counter(self.rows["doc_id"]).most_common(1)
        if dup and dup[0][1] > 1:
            raise ConservationError(
                f"stage {self.stage}: document id {dup[0][0]!r} appears {dup[0][1]} times in the ledger"
            )
        return {"documents_in": n_inputs, "documents_out": n_outputs, "fates": self.counts()}

    def write(self, folder: Path) -> Path:
        path = Path(folder) / LEDGER
        table = pa.table(self.rows, schema=SCHEMA)
        pq.write_table(table, path, compression="zstd", row_group_size=ROWS_PER_GROUP)
        return path


def concat(parts: list[Path], out: Path) -> int:
    """Join the ledgers of record shards in rank order into `out`, one shard at a time; returns the rows.

    Each shard's ledger has unique ids (`Ledger.check`); across shards, ids are compared by their 64-bit
    hashes (8 bytes a document, sorted), and a hash seen twice is looked up to name the id."""
    hashes, pending = [], []
    with pq.ParquetWriter(Path(out) / LEDGER, SCHEMA, compression="zstd") as writer:
        for part in parts:
            table = read(part)
            pending.append(table)
            if sum(t.num_rows for t in pending) >= ROWS_PER_GROUP:
                pending = [_write_groups(writer, pa.concat_tables(pending))]
            ids = table.column("doc_id").to_pylist()
            hashes.append(np.fromiter(map(xxhash.xxh3_64_intdigest, ids), np.uint64, len(ids)))
        rest = pa.concat_tables(pending or [SCHEMA.empty_table()])
        if rest.num_rows or not any(h.size for h in hashes):  # an empty ledger: one empty group, as `write`
            writer.write_table(rest, row_group_size=ROWS_PER_GROUP)
    joined = np.sort(np.concatenate(hashes)) if hashes else np.empty(0, np.uint64)
    twice = joined[1:][joined[1:] == joined[:-1]]
    if twice.size:
        _name_duplicate(parts, set(twice.tolist()))
    return int(joined.size)


def _write_groups(writer: pq.ParquetWriter, table: pa.Table) -> pa.Table:
    """Write the whole row groups in `table`; return the rest."""
    whole = table.num_rows - table.num_rows % ROWS_PER_GROUP
    writer.write_table(table.slice(0, whole), row_group_size=ROWS_PER_GROUP)
    return table.slice(whole)


def _name_duplicate(parts: list[Path], suspects: set[int]) -> None:
    seen: set[str] = set()
    for part in parts:
        for doc_id in read(part).column("doc_id").to_pylist():
            if xxhash.xxh3_64_intdigest(doc_id) in suspects:
                if doc_id in seen:
                    raise ConservationError(f"document id {doc_id!r} appears in more than one shard's ledger")
                seen.add(doc_id)


def read(folder: Path) -> pa.Table:
    return pq.read_table(Path(folder) / LEDGER)
