"""Text sources: a file is one document, read whole but never past the source's `max_doc_bytes`."""

from __future__ import annotations

from pathlib import Path

from moeflow.configs import SourceConfig
from moeflow.ingest import lines
from moeflow.ingest.errors import READ_ERRORS, reason, why
from moeflow.ingest.records import Quarantine, Record, checked_text


def read_limited(path: Path, limit: int, bound: lines.Bound) -> bytes | None:
    """The whole (decompressed) file, or None as soon as it exceeds `limit` bytes (`bound`: see `lines.chunks`)."""
    if path.suffix not in lines.COMPRESSED and path.stat().st_size > limit:
        return None
    parts, size = [], 0
    for chunk in lines.chunks(path, bound):
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)


def record(src: SourceConfig, base: str, path: Path) -> Record:
    try:
        raw = read_limited(path, src.max_doc_bytes, lines.Bound.of(src))
        if raw is None:
            raise Quarantine("too_large", f"over the source's max_doc_bytes ({src.max_doc_bytes:,})")
        return base, path, checked_text(src, raw.decode("utf-8").removeprefix("\ufeff")), None
    except READ_ERRORS as e:
        return base, path, None, Quarantine(reason(e), why(e))
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        return base, path, None, Quarantine("invalid_utf8", f"line {line}, byte {e.start}: {e.reason}")
    except Quarantine as q:
        return base, path, None, q
