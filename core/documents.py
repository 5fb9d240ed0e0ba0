"""The document table that flows between data stages: one Parquet file of (id, source, domain, path, text)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from moeflow.core import columns, faults
from moeflow.core import ledger as ledgers

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


# the columns given dictionaries and min/max statistics; not `text`: its dictionary, built for each row
# group and given up after the first page, cost a worker a fifth of its peak memory and ingest a fifth of
# its time (benchmarks/README.md), and min/max over long strings cost time too; no reader uses either
LABELS = ["id", "source", "domain", "path"]


class DocWriter:
    """Writes documents in row groups, so a stage never holds the whole corpus twice (`compression`: other
    than zstd only for a part that its join rewrites, see `join`)."""

    def __init__(self, folder: Path, rows_per_group: int = 512, compression: str = "zstd"):
        self.path = Path(folder) / DOCS
        self.rows_per_group = rows_per_group
        self.count = 0
        self._buf: dict[str, list] = {name: [] for name in SCHEMA.names}  # by column: no per-row conversion
        self._writer = pq.ParquetWriter(self.path, SCHEMA, compression=compression, use_dictionary=LABELS,
                                        write_statistics=LABELS)
        self._rows: pa.Table | None = None  # rows that came in Arrow (`write_table`), not yet a full group

    def write_table(self, table: pa.Table) -> None:
        """Rows already in Arrow (a join copying its parts), cut into the row groups `write` makes: the file
        is the same whichever way its rows came."""
        if self._buf["id"]:
            raise RuntimeError("DocWriter: write_table after write; use one or the other")
        table = table.select(SCHEMA.names).cast(SCHEMA)
        self._rows = table if self._rows is None else pa.concat_tables([self._rows, table])
        self.count += table.num_rows
        while self._rows.num_rows >= self.rows_per_group:
            self._writer.write_table(self._rows.slice(0, self.rows_per_group).combine_chunks())
            self._rows = self._rows.slice(self.rows_per_group)

    def write(self, doc: dict) -> None:
        for name, column in self._buf.items():
            column.append(doc.get(name))
        self.count += 1
        if len(self._buf["id"]) >= self.rows_per_group:
            self._flush()

    def _flush(self) -> None:
        if self._buf["id"]:
            self._writer.write_table(columns.table(self._buf, SCHEMA))
            self._buf = {name: [] for name in SCHEMA.names}

    def close(self) -> None:
        self._flush()
        if self._rows is not None and self._rows.num_rows:
            self._writer.write_table(self._rows.combine_chunks())
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
    folder: Path, columns: list[str] | None = None, shard: tuple[int, int] = (0, 1), use_threads: bool = True
) -> Iterator[dict]:
    """Documents of a stage's output (or of one record shard of it), in stored order.

    Reads a row group at a time (`use_threads`: as `iter_tables`).
    """
    for table in iter_tables(folder, columns, shard, use_threads):
        yield from table.to_pylist()


def iter_tables(
    folder: Path, columns: list[str] | None = None, shard: tuple[int, int] = (0, 1), use_threads: bool = True
) -> Iterator[pa.Table]:
    """`iter_docs`'s rows as Arrow tables, the shard's part of one row group each, for a stage that needs
    no document as Python objects. `use_threads=False`: each row group decoded on this thread, its memory
    from this thread's heap (Arrow's threads spread a worker's allocations over more heaps, each kept)."""
    f = pq.ParquetFile(Path(folder) / DOCS)
    rows = shard_rows(f.metadata.num_rows, shard)
    start = 0
    for i in range(f.num_row_groups):
        n = f.metadata.row_group(i).num_rows
        lo, hi = max(rows.start, start), min(rows.stop, start + n)
        if lo < hi:
            yield f.read_row_group(i, columns=columns, use_threads=use_threads).slice(lo - start, hi - lo)
            faults.reached(hi - rows.start, len(rows))  # `make chaos`: a kill point by documents read
        start += n


def count_docs(folder: Path, shard: tuple[int, int] = (0, 1)) -> int:
    return len(shard_rows(pq.ParquetFile(Path(folder) / DOCS).metadata.num_rows, shard))


def join(parts: list[Path], out: Path, stage: str, copy: bool = True) -> dict:
    """Join record shards' documents and ledgers in rank order into `out`, a row group at a time (one
    shard's files are copied, unless `copy` is False: parts written otherwise than `DocWriter`'s default, as
    ingest's are), and check that they account for every document."""
    stats = {"documents_in": 0, "documents_out": 0, "fates": Counter()}
    for part in parts:
        s = json.loads((Path(part) / "manifest.json").read_text())["stats"]
        stats["documents_in"] += s["documents_in"]
        stats["documents_out"] += s["documents_out"]
        stats["fates"].update(s["fates"])
    if len(parts) == 1 and copy:
        for name in (DOCS, ledgers.LEDGER):
            shutil.copyfile(Path(parts[0]) / name, Path(out) / name)
        n_out, n_ledger = count_docs(out), pq.ParquetFile(Path(out) / ledgers.LEDGER).metadata.num_rows
    else:
        with DocWriter(out) as writer:
            for part in parts:
                f = pq.ParquetFile(Path(part) / DOCS)
                for i in range(f.num_row_groups):
                    writer.write_table(f.read_row_group(i))
        n_out, n_ledger = writer.count, ledgers.concat(parts, out)
    if n_ledger != stats["documents_in"] or n_out != stats["documents_out"]:
        raise ledgers.ConservationError(
            f"{stage} join: shards account for {stats['documents_in']} documents ({stats['documents_out']} "
            f"kept) but hold {n_ledger} ledger rows and {n_out} documents"
        )
    return {**stats, "fates": dict(sorted(stats["fates"].items()))}
