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
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from moeflow.configs import Format, RunConfig, SourceConfig
from moeflow.documents import DocWriter
from moeflow.lineage.ledger import Ledger
from moeflow.sources import cache_dir, fetch

log = logging.getLogger(__name__)


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
                log.warning(
                    "source %r skipped: package %s is not fetched on this machine", src.name, src.package
                )
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
    files = [
        f for f in files if not any(fnmatch.fnmatch(f.relative_to(root).as_posix(), x) for x in src.exclude)
    ]
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


def resolve_sources(cfg: RunConfig) -> list[ResolvedSource]:
    """Resolve every source before any work; raise on the first that matches nothing."""
    return resolve_sources_list(cfg.sources)


def resolve_sources_list(sources) -> list[ResolvedSource]:
    return [r for r in (resolve_source(s) for s in sources) if r is not None]


CHUNK = 1 << 20
# zlib.error: corrupt deflate data in a .gz; ArrowInvalid: a parquet file whose footer is unreadable
READ_ERRORS = (OSError, EOFError, zlib.error, zstandard.ZstdError, gzip.BadGzipFile, pa.ArrowInvalid)


def _chunks(path: Path) -> Iterator[bytes]:
    """A file's decompressed bytes (by extension: .gz, .zst, else raw) in chunks of about 1 MB, so no
    source file is ever held whole. A file cut inside a zstd frame raises EOFError (zstandard's stream
    reader would end quietly); gzip raises EOFError itself. Every byte decoded before a read error is
    yielded before it is raised: unbuffered reads, and gzip's `read1` (its `read` drops the bytes it
    decoded in the call that fails)."""
    with open(path, "rb", buffering=0) as f:
        if path.suffix == ".gz":
            with gzip.open(f) as g:
                while chunk := g.read1(CHUNK):
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


def _why(e: Exception) -> str:
    """An error as a ledger detail names it (zlib's is called just `error`)."""
    name = type(e).__name__
    return f"{type(e).__module__ + '.' if name == 'error' else ''}{name}: {e}"


class LineCut(Exception):
    """A read error part-way through a line stream: the error, the bytes of the line it cut (b"" when it
    fell between lines), and the number of the last line read (set by `_jsonl_rows`; the cut one included)."""

    def __init__(self, error: Exception, partial: bytes):
        super().__init__(_why(error))
        self.error, self.partial, self.line = error, partial, 0


def _lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Complete lines of a chunk stream; a read error mid-file comes out after the lines before it, as a
    `LineCut` holding the line it cut short (so that line can be accounted for, not lost)."""
    pending: list[bytes] = []  # the current line's pieces (a long line spans many chunks)
    try:
        for chunk in chunks:
            parts = chunk.split(b"\n")
            if len(parts) > 1:
                yield b"".join(pending) + parts[0]
                yield from parts[1:-1]
                pending = []
            pending.append(parts[-1])
    except READ_ERRORS as e:
        raise LineCut(e, b"".join(pending)) from e
    tail = b"".join(pending)
    if tail:
        yield tail


class Quarantine(Exception):
    """A record that cannot become a document: (reason, detail)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


Record = tuple[str, Path, str | None, Quarantine | None]  # (doc id, file, text, quarantine)


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
        raise Quarantine(
            "too_large", f"{size:,} bytes, over the source's max_doc_bytes ({src.max_doc_bytes:,})"
        )
    return value


def _records(rs: ResolvedSource) -> Iterator[tuple[str, Path, str | None, Quarantine | None]]:
    """(doc id, file, text, quarantine) for every record of a source, bad ones included; files are streamed.

    A file that becomes unreadable part-way keeps the records read before the error, and the ledger counts
    what is left one row per record where the format can tell how many there are (all `unreadable_file`):
    - text: a file is one record, `<source>/<file>`.
    - parquet: the footer gives the file's row count, so each row not read is a row `<base>#L<n>`. If the
      footer itself is unreadable, one row `<base>` (the count is unknown).
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
    emitted = 0
    for path in rs.files:
        base = f"{src.name}/{path.relative_to(rs.root).as_posix()}"
        if src.format == Format.text:
            yield _text_record(src, base, path)
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
        except (LineCut, *READ_ERRORS) as e:  # the records before the error are in; account for the rest
            yield from _unread(src, base, path, read, e)


def _text_record(src: SourceConfig, base: str, path: Path) -> Record:
    try:
        raw = _read_limited(path, src.max_doc_bytes)
        if raw is None:
            raise Quarantine("too_large", f"over the source's max_doc_bytes ({src.max_doc_bytes:,})")
        return base, path, _text(src, raw.decode("utf-8")), None
    except READ_ERRORS as e:
        return base, path, None, Quarantine("unreadable_file", _why(e))
    except UnicodeDecodeError as e:
        return base, path, None, Quarantine("invalid_utf8", f"byte {e.start}: {e.reason}")
    except Quarantine as q:
        return base, path, None, q


def _unread(src: SourceConfig, base: str, path: Path, read: int, e: Exception) -> Iterator[Record]:
    """Ledger rows for what a read error left of a jsonl/parquet file, `read` records in (see `_records`)."""
    why = str(e) if isinstance(e, LineCut) else _why(e)
    total = _parquet_total(path) if src.format == Format.parquet else None
    if total is not None:  # the footer counts the rows, so each unread one is a row of its own
        for n in range(read + 1, total + 1):
            yield f"{base}#L{n}", path, None, Quarantine("unreadable_file", f"row {n} of {total}: {why}")
    elif not read:
        yield (
            base,
            path,
            None,
            Quarantine(
                "unreadable_file", f"{why} (before any record; how many records the file holds is unknown)"
            ),
        )
    else:
        after = f"line {e.line}" if isinstance(e, LineCut) else f"{read} records"
        yield (
            f"{base}#rest",
            path,
            None,
            Quarantine(
                "unreadable_file",
                (
                    f"{why} (nothing after {after} could be read: how many records the rest of the file "
                    "holds is unknown, maybe none; this one row stands for them)"
                ),
            ),
        )


def _parquet_total(path: Path) -> int | None:
    """The row count a parquet file's footer records, or None when the footer cannot be read."""
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except READ_ERRORS:
        return None


def _record(
    src: SourceConfig, base: str, path: Path, line_no: int, row
) -> tuple[str, Path, str | None, Quarantine | None]:
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
    """(line number, parsed object or Quarantine) per non-blank line; a line cut by a read error is
    quarantined as truncated, then the `LineCut` goes on, carrying the number of the last line read."""
    line_no = 0
    try:
        for line_no, line in enumerate(lines, start=1):
            if line.strip():
                yield line_no, _json_row(line_no, line)
    except LineCut as cut:
        if not cut.partial.strip():  # the error fell between lines (or after blanks): nothing was cut
            cut.line = line_no
            raise
        cut.line = line_no + 1  # a record was begun: it counts, under the line number it would have had
        yield (
            cut.line,
            Quarantine(
                "unreadable_file",
                (f"line {cut.line} truncated by the read error after {len(cut.partial):,} bytes: {cut}"),
            ),
        )
        raise


def _json_row(line_no: int, line: bytes) -> object:
    try:
        return json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        return Quarantine("invalid_utf8", f"line {line_no}, byte {e.start}: {e.reason}")
    except json.JSONDecodeError as e:
        return Quarantine("invalid_json", f"line {line_no}: {e.msg} at column {e.colno}")


def _portable(path: Path) -> str:
    """A raw file's path as lineage records it: `cache:<path in the data cache>` or absolute."""
    try:
        return "cache:" + path.resolve().relative_to(cache_dir()).as_posix()
    except ValueError:
        return str(path.resolve())


def stage(sources: tuple[SourceConfig, ...], inputs: dict, out: Path) -> dict:
    """The `ingest` stage's body: every configured source, resolved against the data cache."""
    return run(resolve_sources_list(sources), out)


def run(sources: list[ResolvedSource], out: Path) -> dict:
    """Write `docs.parquet` and `ledger.parquet` into `out`; return stats (per source and fate)."""
    ledger = Ledger("ingest", out)
    per_source: dict[str, dict] = {}
    seen: set[str] = set()
    n_in = 0
    with DocWriter(out) as writer:
        for rs in sources:
            src = rs.config
            stats = per_source.setdefault(
                src.name,
                {
                    "files": len(rs.files),
                    "documents": 0,
                    "kept": 0,
                    "quarantined": 0,
                    "bytes": 0,
                    "version": rs.version,
                    "package": src.package,
                    "license": src.license,
                    "domain": src.domain,
                },
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
                writer.write(
                    {
                        "id": doc_id,
                        "source": src.name,
                        "domain": src.domain,
                        "path": _portable(path),
                        "text": text,
                    }
                )
                ledger.kept(doc_id)
                stats["kept"] += 1
                stats["bytes"] += len(text.encode("utf-8"))
        n_out = writer.count
    ledger.write()
    return {**ledger.check(n_in, n_out), "sources": per_source}
