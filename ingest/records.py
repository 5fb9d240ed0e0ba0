"""What every reader yields: a record (doc id, file, text or the `Quarantine` saying why there is none),
built by the checks every format's text passes, and the rows that stand for what a read error left unread."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from moeflow.configs import SourceConfig
from moeflow.ingest.errors import reason, why
from moeflow.ingest.lines import LineCut
from moeflow.ingest.names import printable


class Quarantine(Exception):
    """A record that cannot become a document: (reason, detail)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


Record = tuple[str, Path, str | None, Quarantine | None]  # (doc id, file, text, quarantine)


def checked_text(src: SourceConfig, value) -> str:
    if not isinstance(value, str):
        kind = "missing" if value is None else f"a {type(value).__name__}"
        raise Quarantine("bad_text_field", f"field {src.text_field!r} is {kind}, not a string")
    if "\x00" in value:
        raise Quarantine("nul_bytes", "text contains NUL bytes")
    if not value.strip():
        raise Quarantine("empty_text", "text is empty or whitespace only")
    try:
        size = utf8_size(value)
    except UnicodeEncodeError as e:  # a lone surrogate: valid JSON (`"\ud800"`), not text
        detail = f"character {e.start}: lone surrogate {value[e.start]!r}"
        raise Quarantine("invalid_unicode", detail) from None
    if size > src.max_doc_bytes:
        raise Quarantine(
            "too_large", f"{size:,} bytes, over the source's max_doc_bytes ({src.max_doc_bytes:,})"
        )
    return value


def utf8_size(text: str) -> int:
    """The bytes of `text` in UTF-8 (encoded only when it is not ASCII)."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def unread(base: str, path: Path, read: int, e: Exception) -> Iterator[Record]:
    """Ledger rows for what a read error left of a jsonl file (or a parquet file whose footer cannot be
    read), `read` records in (see `reader.records`)."""
    fate = reason(e.error if isinstance(e, LineCut) else e)
    detail = str(e) if isinstance(e, LineCut) else why(e)
    if not read:
        yield (
            base,
            path,
            None,
            Quarantine(fate, f"{detail} (before any record; how many records the file holds is unknown)"),
        )
    else:
        after = f"line {e.line}" if isinstance(e, LineCut) else f"{read} records"
        yield (
            f"{base}#rest",
            path,
            None,
            Quarantine(
                fate,
                (
                    f"{detail} (nothing after {after} could be read: how many records the rest of the file "
                    "holds is unknown, maybe none; this one row stands for them)"
                ),
            ),
        )


def row_record(
    src: SourceConfig, base: str, path: Path, line_no: int, row
) -> tuple[str, Path, str | None, Quarantine | None]:
    doc_id = f"{base}#L{line_no}"
    if isinstance(row, Quarantine):
        return doc_id, path, None, row
    if src.id_field and isinstance(row, dict) and row.get(src.id_field) is not None:
        doc_id = printable(f"{src.name}/{row[src.id_field]}")
    try:
        if not isinstance(row, dict):
            raise Quarantine("not_an_object", f"line {line_no} is a JSON {type(row).__name__}, not an object")
        return doc_id, path, checked_text(src, row.get(src.text_field)), None
    except Quarantine as q:
        return doc_id, path, None, q
