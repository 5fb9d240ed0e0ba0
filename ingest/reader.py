"""Every format's reader behind one call: the records of a source, or of one unit of it, each file read by
its format's module (`text`, `jsonl`, `parquet`, `hf`) and whatever a read error left accounted for."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from moeflow.configs import Format, SourceConfig
from moeflow.ingest import hf, jsonl, parquet, text
from moeflow.ingest.errors import READ_ERRORS
from moeflow.ingest.lines import Bound, LineCut
from moeflow.ingest.names import relative_name
from moeflow.ingest.plan import Unit
from moeflow.ingest.records import Record, row_record, unread
from moeflow.ingest.resolve import ResolvedSource


def records(rs: ResolvedSource, unit: Unit | None = None) -> Iterator[Record]:
    """(doc id, file, text, quarantine) for every record of a source (or of one `Unit` of it), bad ones
    included; files are streamed.

    A file that becomes unreadable part-way keeps the records read before the error, and the ledger counts
    what is left one row per record where the format can tell how many there are (all `unreadable_file`):
    - text: a file is one record, `<source>/<file>`.
    - parquet: the footer gives each row group's row count, so each row a failing group leaves unread is a
      row `<base>#L<n>`, and the next group is read. If the footer itself is unreadable, one row `<base>`
      (the count is unknown).
    - jsonl (raw, .gz, .zst): every byte read or decoded before the error is used (a cut .gz gives all it
      can inflate before the cut, a cut .zst every block complete before it), so its whole lines are records
      as usual. The line the error cut is `<base>#L<n>`, its detail saying it was truncated. The bytes past
      the error cannot be read or decoded (an OS read error; a cut or corrupt stream), so how many lines they
      hold is unknown: one row `<base>#rest` stands for them, saying so (`<base>` if no line was read). We do
      not skip to a later zstd frame or gzip member: the lines lost before it are uncounted, so later lines
      would have no stable number. A corrupt (not cut) stream also loses what the failing decompress call
      had decoded (.zst: from up to 1 MB of input; .gz: from one read of at most 128 KB), and a checksum
      error comes after its frame's or member's data was read: those records stay.
    """
    src = rs.config
    unit = unit or Unit(0, (0, len(rs.files)))
    emitted = 0
    for path in rs.files[unit.files[0] : unit.files[1]]:
        base = f"{src.name}/{relative_name(path, rs.root)}"
        if src.format == Format.text:
            yield text.record(src, base, path)
            continue
        read = 0
        try:
            for line_no, row in _rows(src, path, unit):
                if src.max_docs and emitted >= src.max_docs:
                    return
                emitted += 1
                read += 1
                yield row_record(src, base, path, line_no, row)
        except (LineCut, *READ_ERRORS) as e:  # the records before the error are in; account for the rest
            yield from unread(base, path, read, e)


def _rows(src: SourceConfig, path: Path, unit: Unit) -> Iterator[tuple[int, object]]:
    """(record number in the file, row or Quarantine) for the part of a file `unit` holds (not text)."""
    if src.format in (Format.hf_dataset, Format.hf_files):
        yield from hf.rows(src, path)
    elif src.format == Format.parquet:
        yield from parquet.rows(path, unit.groups, Bound.of(src))
    else:
        yield from jsonl.rows(src, path, unit.span)
