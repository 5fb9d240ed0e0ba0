"""Parquet sources: a record per row, read a row group at a time; the footer's row counts let a group that
fails part-way, or whose footer sizes say it expands past the source's bound, have each row it left unread
accounted for."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq

from moeflow.ingest.errors import READ_ERRORS, reason, why
from moeflow.ingest.lines import Bound
from moeflow.ingest.records import Quarantine


def rows(path: Path, groups: tuple[int, int] | None, bound: Bound
         ) -> Iterator[tuple[int, object]]:
    """(row number in the file, row or Quarantine) for a parquet file, or for its row groups `[lo, hi)`,
    read a group at a time: a group that fails part-way has its unread rows quarantined (the footer counts
    them) and the next group is read, so what a shard keeps does not depend on where its range starts. A group
    whose footer gives it more uncompressed bytes than `bound` allows for its compressed ones is not read: its
    rows are quarantined `decompression_bomb`."""
    f = pq.ParquetFile(path)
    meta = f.metadata
    counts = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    lo, hi = groups or (0, len(counts))
    n = sum(counts[:lo])
    for g in range(lo, hi):
        stop = n + counts[g]
        try:
            check_group(meta.row_group(g), bound, path)
            for batch in f.iter_batches(batch_size=1024, row_groups=[g]):
                for row in batch.to_pylist():
                    n += 1
                    yield n, row
        except READ_ERRORS as e:
            for m in range(n + 1, stop + 1):
                yield m, Quarantine(reason(e), f"row {m} of {meta.num_rows}: {why(e)}")
        n = stop


def check_group(group: pq.RowGroupMetaData, bound: Bound, path: Path) -> None:
    """Raise `DecompressionBomb` if a row group's footer gives it more uncompressed bytes than `bound` allows for
    its compressed ones."""
    bound.check(group.total_byte_size, sum(group.column(c).total_compressed_size for c in range(group.num_columns)),
                path)


def row_groups(path: Path) -> list[int]:
    """A parquet file's rows per row group ([] when its footer cannot be read: the file is one unit)."""
    try:
        meta = pq.ParquetFile(path).metadata
    except READ_ERRORS:
        return []
    return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
