"""The document table that flows between data stages: one Parquet file of (id, source, domain, path, text)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DOCS = "docs.parquet"
SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),
        ("domain", pa.string()),
        ("path", pa.string()),  # the raw file the document came from (inside the data cache or the user's)
        ("text", pa.large_string()),
    ]
)


class DocWriter:
    """Writes documents in row groups, so a stage never holds the whole corpus twice."""

    def __init__(self, folder: Path, rows_per_group: int = 512):
        self.path = Path(folder) / DOCS
        self.rows_per_group = rows_per_group
        self.count = 0
        self._buf: list[dict] = []
        self._writer = pq.ParquetWriter(self.path, SCHEMA, compression="zstd")

    def write(self, doc: dict) -> None:
        self._buf.append(doc)
        self.count += 1
        if len(self._buf) >= self.rows_per_group:
            self._flush()

    def _flush(self) -> None:
        if self._buf:
            self._writer.write_table(pa.Table.from_pylist(self._buf, schema=SCHEMA))
            self._buf = []

    def close(self) -> None:
        self._flush()
        self._writer.close()

    def __enter__(self) -> DocWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def shard_rows(num_rows: int, shard: tuple[int, int]) -> range:
    """The rows of record shard `rank` of `world_size`: a contiguous range, so shards joined in rank
    order give the input's order."""
    rank, world = shard
    if not 0 <= rank < world:
        raise ValueError(f"shard rank {rank} is not in [0, {world})")
    return range(rank * num_rows // world, (rank + 1) * num_rows // world)


def iter_docs(
    folder: Path, columns: list[str] | None = None, shard: tuple[int, int] = (0, 1)
) -> Iterator[dict]:
    """Documents of a stage's output (or of one record shard of it), in stored order.

    Reads a row group at a time.
    """
    f = pq.ParquetFile(Path(folder) / DOCS)
    rows = shard_rows(f.metadata.num_rows, shard)
    start = 0
    for i in range(f.num_row_groups):
        n = f.metadata.row_group(i).num_rows
        lo, hi = max(rows.start, start), min(rows.stop, start + n)
        if lo < hi:
            table = f.read_row_group(i, columns=columns)
            yield from table.slice(lo - start, hi - lo).to_pylist()
        start += n


def count_docs(folder: Path, shard: tuple[int, int] = (0, 1)) -> int:
    return len(shard_rows(pq.ParquetFile(Path(folder) / DOCS).metadata.num_rows, shard))
