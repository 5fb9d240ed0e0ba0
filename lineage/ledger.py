"""The document ledger: one row per input document of a data stage with its fate, and conservation.

Fates: `kept`; `dropped` (reason = the filter's reason string); `duplicate` (detail = the
representative's id); `contaminated` (detail = benchmark and item); `quarantined` (reason = the
error). A stage fails unless its inputs equal the sum of its fates and its output holds exactly
the kept documents.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

FATES = ("kept", "dropped", "duplicate", "contaminated", "quarantined")
LEDGER = "ledger.parquet"
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
        pq.write_table(pa.table(self.rows, schema=SCHEMA), path, compression="zstd")
        return path


def concat(parts: list[Path], out: Path) -> pa.Table:
    """Join the ledgers of record shards in rank order into `out`; a document id twice is an error."""
    table = pa.concat_tables([read(p) for p in parts])
    ids = table.column("doc_id").to_pylist()
    if len(set(ids)) != len(ids):
        dup = Counter(ids).most_common(1)[0][0]
        raise ConservationError(f"document id {dup!r} appears in more than one shard's ledger")
    pq.write_table(table, Path(out) / LEDGER, compression="zstd")
    return table


def read(folder: Path) -> pa.Table:
    return pq.read_table(Path(folder) / LEDGER)
