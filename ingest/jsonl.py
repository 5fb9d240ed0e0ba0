"""JSONL sources (plain, .gz, .zst): a record per line, numbered from 1; a plain file can be read from any
byte span, its line numbers counted from the file's start."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson

from moeflow.configs import SourceConfig
from moeflow.ingest import lines
from moeflow.ingest.errors import reason
from moeflow.ingest.lines import LineCut, Overlong
from moeflow.ingest.records import Quarantine


def rows(src: SourceConfig, path: Path, span: tuple[int, int] | None) -> Iterator[tuple[int, object]]:
    """(line number, parsed object or Quarantine) for the lines of a file, or for those that start in
    the byte span `[lo, hi)` of a plain file."""
    if span:
        begin, before = _span_start(path, span[0])
        stream = lines.split(_span_chunks(path, begin, span[1]), _line_limit(src))
        yield from parsed(stream, before + 1, _fields(src))
    else:
        yield from parsed(lines.split(lines.chunks(path, lines.Bound.of(src)), _line_limit(src)), 1, _fields(src))


def _fields(src: SourceConfig) -> tuple[str, ...]:
    """The fields ingest reads of a record (`records.row_record`)."""
    return (src.text_field, src.id_field) if src.id_field else (src.text_field,)


def _line_limit(src: SourceConfig) -> int:
    """The longest JSONL line parsed: one whose text field could be `max_doc_bytes` (JSON escapes take up
    to 6 bytes a byte of text), plus 1 MiB for the other fields."""
    return 6 * src.max_doc_bytes + (1 << 20)


def parsed(stream: Iterator[bytes | Overlong], first: int = 1, fields: tuple[str, ...] = ()
           ) -> Iterator[tuple[int, object]]:
    """(line number, parsed object or Quarantine) per non-blank line, the first numbered `first` (`fields`:
    those read of each object, see `_fast`); a line cut by a read error is quarantined as truncated, then
    the `LineCut` goes on, carrying the number of the last line read."""
    line_no = first - 1
    try:
        for line_no, line in enumerate(stream, start=first):
            if isinstance(line, Overlong) or line.strip():
                yield line_no, _json_row(line_no, line, fields)
    except LineCut as cut:
        if not cut.partial.strip():  # the error fell between lines (or after blanks): nothing was cut
            cut.line = line_no
            raise
        cut.line = line_no + 1  # a record was begun: it counts, under the line number it would have had
        yield (
            cut.line,
            Quarantine(
                reason(cut.error),
                (f"line {cut.line} truncated by the read error after {cut.size:,} bytes: {cut}"),
            ),
        )
        raise


# a line holding more brackets than this is parsed by `json` alone: `json` gives up at its recursion limit
# (1,000 levels less the caller's depth, a few dozen), orjson at 1,024, so a line nested between the two
# would be read by one and quarantined by the other
_FAST_BRACKETS = 400
# a line nested deeper than this is invalid_json, checked by counting (`_depth`), not left to `json`'s recursion
# limit, which any library in a long-lived worker may raise (with it raised, a 1,000-deep line read as a list)
MAX_DEPTH = 512
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NESTING = np.zeros(256, np.int8)
_NESTING[[ord("["), ord("{")]], _NESTING[[ord("]"), ord("}")]] = 1, -1


def _depth(line: bytes) -> int:
    """The deepest nesting of arrays and objects in a line, brackets inside strings left out."""
    steps = _NESTING[np.frombuffer(_STRINGS.sub(b"", line), np.uint8)].astype(np.int32)
    return int(np.cumsum(steps).max(initial=0))


def _fast(line: bytes, fields: tuple[str, ...]) -> dict | None:
    """orjson's parse of a line where what ingest reads of it (`fields`: the text and id fields' values) is
    what `json.loads` makes: no float in them (orjson reads an integer past 64 bits as a float, `json` as
    an int) and too few brackets to near either parser's nesting limit. None where `json` must decide:
    orjson refused the line (`json` accepts more: NaN, lone surrogates, a byte-order mark; or it says what
    is wrong) or read something other than such an object."""
    if line.count(b"[") + line.count(b"{") > _FAST_BRACKETS:
        return None
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if type(row) is not dict or any(_holds_float(row.get(f)) for f in fields):
        return None
    return row


def _holds_float(value) -> bool:
    kind = type(value)
    if kind is list:
        return any(map(_holds_float, value))
    return kind is float or (kind is dict and any(map(_holds_float, value.values())))


def _json_row(line_no: int, line: bytes | Overlong, fields: tuple[str, ...] = ()) -> object:
    """A line parsed, or the Quarantine that says why it cannot be (a UTF-8 byte-order mark opening the
    file is dropped). orjson parses the common line (`_fast`: `fields` are those read of it); `json` the rest.
    """
    if isinstance(line, Overlong):
        return Quarantine("too_large", f"line {line_no}: {line.size:,} bytes, over the line limit (6 x "
                                       "max_doc_bytes + 1 MiB: its text could not fit); not parsed")
    if (row := _fast(line, fields)) is not None:
        return row
    if line.count(b"[") + line.count(b"{") > MAX_DEPTH and _depth(line) > MAX_DEPTH:
        return Quarantine("invalid_json", f"line {line_no}: nested deeper than {MAX_DEPTH} levels")
    try:
        text = line.decode("utf-8")
        return json.loads(text.removeprefix("\ufeff") if line_no == 1 else text)
    except UnicodeDecodeError as e:
        return Quarantine("invalid_utf8", f"line {line_no}, byte {e.start}: {e.reason}")
    except json.JSONDecodeError as e:
        return Quarantine("invalid_json", f"line {line_no}: {e.msg} at column {e.colno}")
    except RecursionError:
        return Quarantine("invalid_json", f"line {line_no}: nested deeper than the JSON parser's limit")
    except ValueError as e:  # e.g. an integer of more than 4,300 digits
        return Quarantine("invalid_json", f"line {line_no}: {e}")


def _span_start(path: Path, start: int) -> tuple[int, int]:
    """Where the first line starting at or after byte `start` begins, and how many lines come before it
    (read with unbuffered 1 MB reads: newlines are counted, nothing is parsed)."""
    if start == 0:
        return 0, 0
    count, pos = 0, 0
    with open(path, "rb", buffering=0) as f:
        while pos < start - 1:  # bytes [0, start - 1): their newlines
            chunk = f.read(min(lines.CHUNK, start - 1 - pos))
            if not chunk:
                return pos, count
            count, pos = count + chunk.count(b"\n"), pos + len(chunk)
        while chunk := f.read(lines.CHUNK):  # from byte start - 1 on: the end of the line it is in
            cut = chunk.find(b"\n")
            if cut >= 0:
                return pos + cut + 1, count + 1
            pos += len(chunk)
    return pos, count


def _span_chunks(path: Path, begin: int, stop: int) -> Iterator[bytes]:
    """The bytes of the lines of a plain file that start in `[begin, stop)`, `begin` being a line start:
    up to `stop`, then to the end of the line that `stop` falls in."""
    with open(path, "rb", buffering=0) as f:
        f.seek(begin)
        pos, last = begin, b"\n"
        while pos < stop and (chunk := f.read(min(lines.CHUNK, stop - pos))):
            pos, last = pos + len(chunk), chunk[-1:]
            yield chunk
        while last != b"\n" and pos >= stop and (chunk := f.read(lines.CHUNK)):
            cut = chunk.find(b"\n")
            yield chunk if cut < 0 else chunk[: cut + 1]
            last = b"" if cut < 0 else b"\n"
