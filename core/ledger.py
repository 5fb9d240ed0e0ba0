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

from moeflow.core import columns

FATES = ("kept", "dropped", "duplicate", "contaminated", "quarantined")
LEDGER = "ledger.parquet"
ROWS_PER_GROUP = 65_536  # fixed, so a ledger joined from any number of shards has the same bytes
SCHEMA = pa.schema(
    [("doc_id", pa.string()), ("fate", pa.string()), ("reason", pa.string()), ("detail", pa.string())]
)


class ConservationError(RuntimeError):
    """A stage lost or invented documents."""


class Ledger:
    """A stage's ledger, written to `folder` a row group at a time as documents are accounted for: memory
    holds one group, the counts, and 8 bytes a document (the ids' hashes, for the uniqueness check)."""

    def __init__(self, stage: str, folder: Path):
        self.stage = stage
        self.path = Path(folder) / LEDGER
        self.rows: dict[str, list] = {name: [] for name in SCHEMA.names}
        self.fates: Counter = Counter()
        self.hashes: list[np.ndarray] = []
        self.writer: pq.ParquetWriter | None = None

    def add(self, doc_id: str, fate: str, reason: str = "", detail: str = "") -> None:
        if fate not in FATES:
            raise ValueError(f"unknown fate {fate!r}")
        self.rows["doc_id"].append(doc_id)
        self.rows["fate"].append(fate)
        self.rows["reason"].append(reason)
        self.rows["detail"].append(detail)
        self.fates[fate] += 1
        if reason:
            self.fates[f"{fate}:{reason}"] += 1
        if len(self.rows["doc_id"]) == ROWS_PER_GROUP:
            self._flush()

    def kept(self, doc_id: str) -> None:
        self.add(doc_id, "kept")

    def _flush(self) -> None:
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.path, SCHEMA, compression="zstd")
        ids = self.rows["doc_id"]
        if ids or not self.hashes:  # an empty ledger: one empty group
            self.writer.write_table(columns.table(self.rows, SCHEMA), row_group_size=ROWS_PER_GROUP)
        self.hashes.append(np.fromiter(map(xxhash.xxh3_64_intdigest, ids), np.uint64, len(ids)))
        self.rows = {name: [] for name in SCHEMA.names}

    def write(self) -> Path:
        """Write the last rows and close the file."""
        self._flush()
        self.writer.close()
        return self.path

    def check(self, n_inputs: int, n_outputs: int, unique: bool = True) -> dict:
        """Enforce conservation on the written ledger (and unique ids, unless `unique` is False: a shard
        whose join resolves repeats); return the stats block that lineage records."""
        total = sum(self.fates[f] for f in FATES)
        if total != n_inputs:
            raise ConservationError(
                f"stage {self.stage}: {n_inputs} input documents but the ledger accounts for {total} "
                f"({ {f: self.fates[f] for f in FATES if self.fates[f]} })"
            )
        if self.fates["kept"] != n_outputs:
            raise ConservationError(
                f"stage {self.stage}: ledger keeps {self.fates['kept']} documents but the output holds "
                f"{n_outputs}"
            )
        if unique:
            _unique(self.hashes, [self.path.parent], f"stage {self.stage}: document id {{!r}} appears twice "
                    "in the ledger")
        return {"documents_in": n_inputs, "documents_out": n_outputs, "fates": dict(sorted(self.fates.items()))}


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
            hashes.append(_hashes(table))
        rest = pa.concat_tables(pending or [SCHEMA.empty_table()])
        if rest.num_rows or not any(h.size for h in hashes):  # an empty ledger: one empty group, as `write`
            writer.write_table(rest, row_group_size=ROWS_PER_GROUP)
    return _unique(hashes, parts, "document id {!r} appears in more than one shard's ledger")


def _write_groups(writer: pq.ParquetWriter, table: pa.Table) -> pa.Table:
    """Write the whole row groups in `table`; return the rest."""
    whole = table.num_rows - table.num_rows % ROWS_PER_GROUP
    writer.write_table(table.slice(0, whole), row_group_size=ROWS_PER_GROUP)
    return table.slice(whole)


def _hashes(table: pa.Table) -> np.ndarray:
    ids = table.column("doc_id").to_pylist()
    return np.fromiter(map(xxhash.xxh3_64_intdigest, ids), np.uint64, len(ids))


def id_hashes(folder: Path) -> np.ndarray:
    """The 64-bit hashes of a ledger's ids, in its order."""
    return _hashes(read(folder, ["doc_id"]))


def repeated(hashes: list[np.ndarray]) -> set[int]:
    """The hashes that occur more than once in `hashes` (sorted together: 8 bytes a document)."""
    joined = np.sort(np.concatenate(hashes)) if hashes else np.empty(0, np.uint64)
    return set(joined[1:][joined[1:] == joined[:-1]].tolist())


def _unique(hashes: list[np.ndarray], folders: list[Path], message: str) -> int:
    """Fail with `message` (naming the id) when an id is in the ledgers of `folders` twice; returns the rows.
    Ids are compared by their sorted 64-bit hashes; a hash seen twice is looked up to tell a collision."""
    suspects = repeated(hashes)
    seen: set[str] = set()
    for folder in folders if suspects else []:
        for doc_id in read(folder).column("doc_id").to_pylist():
            if xxhash.xxh3_64_intdigest(doc_id) in suspects:
                if doc_id in seen:
                    raise ConservationError(message.format(doc_id))
                seen.add(doc_id)
    return sum(h.size for h in hashes)


def read(folder: Path, columns: list[str] | None = None) -> pa.Table:
    """A stage's ledger (`ParquetFile`, not `pq.read_table`: that goes through `pyarrow.dataset`, which
    imports pandas; see `columns`)."""
    return pq.ParquetFile(Path(folder) / LEDGER).read(columns=columns)
