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
import os
import stat
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import xxhash
import zstandard

from moeflow.configs import Format, RunConfig, SourceConfig
from moeflow.core import ledger as ledgers
from moeflow.core import progress
from moeflow.core.documents import DocWriter, iter_docs, join
from moeflow.core.ledger import Ledger
from moeflow.core.paths import cache_dir
from moeflow.core.progress import tqdm
from moeflow.ingest import hf
from moeflow.sources import fetch

log = logging.getLogger(__name__)


class SourceError(ValueError):
    """A source cannot be read at all; the message names the source and the fix."""


@dataclass(frozen=True)
class ResolvedSource:
    config: SourceConfig
    root: Path  # paths in ids are relative to this
    files: tuple[Path, ...]
    version: str | None  # the fetched package version, when the source comes from a package
    skipped: tuple[str, ...] = ()  # matches left out, each with why (see `_listing`)


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
    if src.format == Format.hf_dataset:
        root, saved = hf.saved_files(src, Path(pattern))
        return ResolvedSource(config=src, root=root, files=tuple(saved), version=version)
    root = _glob_root(pattern)
    root = root.parent if root.is_file() else root  # a single file: its name is in the ids
    files, skipped = _listing(pattern, root, src.exclude)
    for note in skipped:
        log.warning("source %r: %s skipped", src.name, note)
    if not files:
        raise SourceError(
            f"source {src.name!r}: path {pattern!r} matches no files"
            + (" after its exclude patterns" if src.exclude else "")
            + "; fix `path` in the config, or fetch the data with `moeflow fetch`" + hf.hub_hint(src)
        )
    if src.max_docs and src.format == Format.text:
        files = files[: src.max_docs]
    return ResolvedSource(config=src, root=root, files=tuple(files), version=version, skipped=tuple(skipped))


def _listing(pattern: str, root: Path, exclude: tuple[str, ...]) -> tuple[list[Path], list[str]]:
    """The regular files a pattern matches, sorted, each real file once (a file reached by two paths, by a
    link or a link loop, is read at the first); and a note for each match left out that is not a folder:
    an alias, a special file (a FIFO would block the reader), a dangling or looping link."""
    files, skipped, seen = [], [], {}
    for path in sorted(Path(p) for p in glob.glob(pattern, recursive=True)):
        if any(fnmatch.fnmatch(_name(path, root), x) for x in exclude):
            continue
        try:
            st = path.stat()
        except OSError as e:
            skipped.append(f"{_name(path, root)}: {e.strerror}")
            continue
        if stat.S_ISDIR(st.st_mode):
            continue
        if not stat.S_ISREG(st.st_mode):
            skipped.append(f"{_name(path, root)}: not a regular file")
        elif (st.st_dev, st.st_ino) in seen:
            skipped.append(f"{_name(path, root)}: the same file as {_name(seen[st.st_dev, st.st_ino], root)}")
        else:
            seen[st.st_dev, st.st_ino] = path
            files.append(path)
    return files, skipped


def _name(path: Path, root: Path) -> str:
    """A file's path under its source's root as ids name it; bytes that are not UTF-8 as `\\xNN`."""
    return _printable(path.relative_to(root).as_posix())


def _printable(name: str) -> str:
    """A name as text that encodes: a file name's bytes Python could not decode (kept as surrogates) as
    `\\xNN`, any other lone surrogate (an `id_field` value) as `\\uXXXX`."""
    try:
        name.encode("utf-8")
        return name
    except UnicodeEncodeError:
        pass
    try:
        return os.fsencode(name).decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a lone surrogate from JSON (`"\ud800"`), not from the file system
        return name.encode("utf-8", "backslashreplace").decode("utf-8")


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
SPAN_BYTES = 64 << 20  # a plain jsonl file larger than this is read by several shards, this much each
# zlib.error: corrupt deflate data in a .gz; ArrowInvalid: a parquet file whose footer is unreadable
# hf.ReadError: whatever `datasets` raised part-way through a file
READ_ERRORS = (OSError, EOFError, zlib.error, zstandard.ZstdError, gzip.BadGzipFile, pa.ArrowInvalid,
               hf.ReadError)


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

    def __init__(self, error: Exception, partial: bytes, size: int | None = None):
        super().__init__(_why(error))
        self.error, self.partial, self.line = error, partial, 0
        self.size = len(partial) if size is None else size  # the cut line's bytes (`partial`: its head)


class Overlong:
    """A line longer than the reader's limit: its bytes were dropped as they came (`size` counts them), so
    one line never holds more memory than the limit."""

    def __init__(self, size: int):
        self.size = size


def _lines(chunks: Iterator[bytes], limit: int | None = None) -> Iterator[bytes | Overlong]:
    """Complete lines of a chunk stream, a line over `limit` bytes as an `Overlong`; a read error mid-file
    comes out after the lines before it, as a `LineCut` holding the line it cut short (so that line can be
    accounted for, not lost)."""
    line = _Line(limit)  # the current line's pieces (a long line spans many chunks)
    try:
        for chunk in chunks:
            parts = chunk.split(b"\n")
            if len(parts) > 1:
                line.add(parts[0])
                yield line.take()
                for part in parts[1:-1]:
                    yield part if limit is None or len(part) <= limit else Overlong(len(part))
            line.add(parts[-1])
    except READ_ERRORS as e:
        raise LineCut(e, line.head(), line.size) from e
    if line.size:
        yield line.take()


class _Line:
    """The pieces of the line being read, dropped (and only counted) once they pass `limit` bytes."""

    def __init__(self, limit: int | None):
        self.limit, self.pieces, self.size, self.over = limit, [], 0, False

    def add(self, piece: bytes) -> None:
        self.size += len(piece)
        if self.limit is not None and self.size > self.limit and not self.over:
            self.pieces, self.over = [self.head()], True
        if not self.over:
            self.pieces.append(piece)

    def head(self) -> bytes:
        return b"".join(self.pieces)[:64]

    def take(self) -> bytes | Overlong:
        line = Overlong(self.size) if self.over else b"".join(self.pieces)
        self.pieces, self.size, self.over = [], 0, False
        return line


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
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as e:  # a lone surrogate: valid JSON (`"\ud800"`), not text
        detail = f"character {e.start}: lone surrogate {value[e.start]!r}"
        raise Quarantine("invalid_unicode", detail) from None
    if size > src.max_doc_bytes:
        raise Quarantine(
            "too_large", f"{size:,} bytes, over the source's max_doc_bytes ({src.max_doc_bytes:,})"
        )
    return value


def _records(rs: ResolvedSource, unit: Unit | None = None) -> Iterator[Record]:
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
        base = f"{src.name}/{_name(path, rs.root)}"
        if src.format == Format.text:
            yield _text_record(src, base, path)
            continue
        read = 0
        try:
            for line_no, row in _rows(src, path, unit):
                if src.max_docs and emitted >= src.max_docs:
                    return
                emitted += 1
                read += 1
                yield _record(src, base, path, line_no, row)
        except (LineCut, *READ_ERRORS) as e:  # the records before the error are in; account for the rest
            yield from _unread(base, path, read, e)


def _text_record(src: SourceConfig, base: str, path: Path) -> Record:
    try:
        raw = _read_limited(path, src.max_doc_bytes)
        if raw is None:
            raise Quarantine("too_large", f"over the source's max_doc_bytes ({src.max_doc_bytes:,})")
        return base, path, _text(src, raw.decode("utf-8").removeprefix("\ufeff")), None
    except READ_ERRORS as e:
        return base, path, None, Quarantine("unreadable_file", _why(e))
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        return base, path, None, Quarantine("invalid_utf8", f"line {line}, byte {e.start}: {e.reason}")
    except Quarantine as q:
        return base, path, None, q


def _unread(base: str, path: Path, read: int, e: Exception) -> Iterator[Record]:
    """Ledger rows for what a read error left of a jsonl file (or a parquet file whose footer cannot be
    read), `read` records in (see `_records`)."""
    why = str(e) if isinstance(e, LineCut) else _why(e)
    if not read:
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


def _record(
    src: SourceConfig, base: str, path: Path, line_no: int, row
) -> tuple[str, Path, str | None, Quarantine | None]:
    doc_id = f"{base}#L{line_no}"
    if isinstance(row, Quarantine):
        return doc_id, path, None, row
    if src.id_field and isinstance(row, dict) and row.get(src.id_field) is not None:
        doc_id = _printable(f"{src.name}/{row[src.id_field]}")
    try:
        if not isinstance(row, dict):
            raise Quarantine("not_an_object", f"line {line_no} is a JSON {type(row).__name__}, not an object")
        return doc_id, path, _text(src, row.get(src.text_field)), None
    except Quarantine as q:
        return doc_id, path, None, q


def _parquet_rows(path: Path, groups: tuple[int, int] | None = None) -> Iterator[tuple[int, object]]:
    """(row number in the file, row or Quarantine) for a parquet file, or for its row groups `[lo, hi)`,
    read a group at a time: a group that fails part-way has its unread rows quarantined (the footer counts
    them) and the next group is read, so what a shard keeps does not depend on where its range starts."""
    f = pq.ParquetFile(path)
    meta = f.metadata
    counts = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    lo, hi = groups or (0, len(counts))
    n = sum(counts[:lo])
    for g in range(lo, hi):
        stop = n + counts[g]
        try:
            for batch in f.iter_batches(batch_size=1024, row_groups=[g]):
                for row in batch.to_pylist():
                    n += 1
                    yield n, row
        except READ_ERRORS as e:
            for m in range(n + 1, stop + 1):
                yield m, Quarantine("unreadable_file", f"row {m} of {meta.num_rows}: {_why(e)}")
        n = stop


def _rows(src: SourceConfig, path: Path, unit: Unit) -> Iterator[tuple[int, object]]:
    """(record number in the file, row or Quarantine) for the part of a file `unit` holds (not text)."""
    if src.format in (Format.hf_dataset, Format.hf_files):
        yield from hf.rows(src, path)
    elif src.format == Format.parquet:
        yield from _parquet_rows(path, unit.groups)
    elif unit.span:
        begin, before = _span_start(path, unit.span[0])
        lines = _lines(_span_chunks(path, begin, unit.span[1]), _line_limit(src))
        yield from _jsonl_rows(lines, first=before + 1)
    else:
        yield from _jsonl_rows(_lines(_chunks(path), _line_limit(src)))


def _line_limit(src: SourceConfig) -> int:
    """The longest JSONL line parsed: one whose text field could be `max_doc_bytes` (JSON escapes take up
    to 6 bytes a byte of text), plus 1 MiB for the other fields."""
    return 6 * src.max_doc_bytes + (1 << 20)


def _span_start(path: Path, start: int) -> tuple[int, int]:
    """Where the first line starting at or after byte `start` begins, and how many lines come before it
    (read with unbuffered 1 MB reads: newlines are counted, nothing is parsed)."""
    if start == 0:
        return 0, 0
    lines, pos = 0, 0
    with open(path, "rb", buffering=0) as f:
        while pos < start - 1:  # bytes [0, start - 1): their newlines
            chunk = f.read(min(CHUNK, start - 1 - pos))
            if not chunk:
                return pos, lines
            lines, pos = lines + chunk.count(b"\n"), pos + len(chunk)
        while chunk := f.read(CHUNK):  # from byte start - 1 on: the end of the line it is in
            cut = chunk.find(b"\n")
            if cut >= 0:
                return pos + cut + 1, lines + 1
            pos += len(chunk)
    return pos, lines


def _span_chunks(path: Path, begin: int, stop: int) -> Iterator[bytes]:
    """The bytes of the lines of a plain file that start in `[begin, stop)`, `begin` being a line start:
    up to `stop`, then to the end of the line that `stop` falls in."""
    with open(path, "rb", buffering=0) as f:
        f.seek(begin)
        pos, last = begin, b"\n"
        while pos < stop and (chunk := f.read(min(CHUNK, stop - pos))):
            pos, last = pos + len(chunk), chunk[-1:]
            yield chunk
        while last != b"\n" and pos >= stop and (chunk := f.read(CHUNK)):
            cut = chunk.find(b"\n")
            yield chunk if cut < 0 else chunk[: cut + 1]
            last = b"" if cut < 0 else b"\n"


def _jsonl_rows(lines: Iterator[bytes], first: int = 1) -> Iterator[tuple[int, object]]:
    """(line number, parsed object or Quarantine) per non-blank line, the first numbered `first`; a line
    cut by a read error is quarantined as truncated, then the `LineCut` goes on, carrying the number of
    the last line read."""
    line_no = first - 1
    try:
        for line_no, line in enumerate(lines, start=first):
            if isinstance(line, Overlong) or line.strip():
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
                (f"line {cut.line} truncated by the read error after {cut.size:,} bytes: {cut}"),
            ),
        )
        raise


def _json_row(line_no: int, line: bytes | Overlong) -> object:
    """A line parsed, or the Quarantine that says why it cannot be (a UTF-8 byte-order mark opening the
    file is dropped)."""
    if isinstance(line, Overlong):
        return Quarantine("too_large", f"line {line_no}: {line.size:,} bytes, over the line limit (6 x "
                                       "max_doc_bytes + 1 MiB: its text could not fit); not parsed")
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


def _portable(path: Path) -> str:
    """A raw file's path as lineage records it: `cache:<path in the data cache>` or absolute."""
    try:
        return "cache:" + _printable(path.resolve().relative_to(cache_dir()).as_posix())
    except ValueError:
        return _printable(str(path.resolve()))


@dataclass(frozen=True)
class Unit:
    """A piece of one source that a shard reads whole: files `[lo, hi)` of the source's sorted list, or of
    one file its row groups `[lo, hi)` (parquet) or the lines that start in bytes `[lo, hi)` (plain jsonl);
    `size` (bytes on disk, estimated for row groups) balances shards."""

    source: int
    files: tuple[int, int]
    groups: tuple[int, int] | None = None
    size: int = 0
    span: tuple[int, int] | None = None

    @property
    def first(self) -> bool:
        """Whether the unit holds its file's start (so the shard reading it counts the file)."""
        return (self.groups or self.span or (0,))[0] == 0

    def join(self, other: Unit) -> Unit | None:
        """This unit and the next one of the same file as one, or None when they are not such."""
        if (self.source, self.files) != (other.source, other.files):
            return None
        if self.groups and other.groups:
            return replace(self, groups=(self.groups[0], other.groups[1]), size=self.size + other.size)
        if self.span and other.span:
            return replace(self, span=(self.span[0], other.span[1]), size=self.size + other.size)
        return None


def units(sources: list[ResolvedSource]) -> list[Unit]:
    """Every source cut into units, in corpus order: a file each, a parquet file's row groups each, a plain
    jsonl file's `SPAN_BYTES` each, and a source with `max_docs` (jsonl, parquet) whole (its cap counts
    records across files). A compressed file is one unit: it cannot be entered part-way."""
    out = []
    for s, rs in enumerate(sources):
        sizes = [_size(f) for f in rs.files]
        if rs.config.max_docs and rs.config.format != Format.text:
            out.append(Unit(s, (0, len(rs.files)), None, sum(sizes)))
            continue
        for i, (path, size) in enumerate(zip(rs.files, sizes, strict=True)):
            groups = _groups(path) if rs.config.format == Format.parquet else []
            plain = rs.config.format == Format.jsonl and path.suffix not in (".gz", ".zst")
            if len(groups) > 1:
                total = sum(groups) or 1
                out += [Unit(s, (i, i + 1), (g, g + 1), size * n // total) for g, n in enumerate(groups)]
            elif plain and size > SPAN_BYTES:
                cuts = [*range(0, size, SPAN_BYTES), size]
                out += [Unit(s, (i, i + 1), size=hi - lo, span=(lo, hi)) for lo, hi in zip(cuts, cuts[1:])]
            else:
                out.append(Unit(s, (i, i + 1), size=size))
    return out


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _groups(path: Path) -> list[int]:
    """A parquet file's rows per row group ([] when its footer cannot be read: the file is one unit)."""
    try:
        meta = pq.ParquetFile(path).metadata
    except READ_ERRORS:
        return []
    return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]


def assign(plan: list[Unit], shard: tuple[int, int]) -> list[Unit]:
    """The units of shard `rank` of `world_size`: a contiguous run of the plan, cut where the running size
    passes each 1/world_size of the total (a unit goes where its middle falls), so shards joined in rank
    order read the corpus in order; consecutive pieces of one file are read as one."""
    rank, world = shard
    if not 0 <= rank < world:
        raise ValueError(f"shard rank {rank} is not in [0, {world})")
    total, done, mine = sum(u.size for u in plan) or 1, 0, []
    for u in plan:
        owner = min(world - 1, (2 * done + u.size) * world // (2 * total))
        done += u.size
        if owner != rank:
            continue
        joined = mine[-1].join(u) if mine else None
        if joined:
            mine[-1] = joined
        else:
            mine.append(u)
    return mine


def _source_stats(rs: ResolvedSource) -> dict:
    src = rs.config
    return {"files": 0, "documents": 0, "kept": 0, "quarantined": 0, "bytes": 0, "version": rs.version,
            "package": src.package, "license": src.license, "domain": src.domain,
            "skipped_paths": len(rs.skipped), "skipped": list(rs.skipped[:20]), "changed": []}


def shard(sources: tuple[SourceConfig, ...], inputs: dict, prior: dict, out: Path,
          part: tuple[int, int]) -> dict:
    """One shard of the `ingest` stage: its units (`assign`) of every configured source."""
    resolved = resolve_sources_list(sources)
    return read(resolved, assign(units(resolved), part), out)


def read(sources: list[ResolvedSource], mine: list[Unit], out: Path) -> dict:
    """Write the documents and ledger of the units `mine` into `out`; return stats (per source and fate).
    Ids are checked for repeats across the whole corpus by `merge`: here a repeated id stays as read."""
    ledger = Ledger("ingest", out)
    per_source: dict[str, dict] = {}
    n_in = 0
    with DocWriter(out) as writer, tqdm(total=sum(u.size for u in mine), desc=progress.task_name("ingest"),
                                        unit="B", unit_scale=True, mininterval=5) as bar:
        for unit in mine:
            bar.update(unit.size)  # as it starts: a unit is read whole
            rs = sources[unit.source]
            stats = per_source.setdefault(rs.config.name, _source_stats(rs))
            if unit.first:  # a file is counted by the shard reading its start
                stats["files"] += unit.files[1] - unit.files[0]
            before = _signatures(rs, unit)
            for doc_id, path, text, q in _records(rs, unit):
                n_in += 1
                stats["documents"] += 1
                if q is not None:
                    log.warning("source %r: %s (%s) quarantined: %s", rs.config.name, path, doc_id, q)
                    ledger.add(doc_id, "quarantined", q.reason, q.detail)
                    stats["quarantined"] += 1
                    continue
                writer.write({"id": doc_id, "source": rs.config.name, "domain": rs.config.domain,
                              "path": _portable(path), "text": text})
                ledger.kept(doc_id)
                stats["kept"] += 1
                stats["bytes"] += len(text.encode("utf-8"))
            stats["changed"] += _changed(rs, unit, before)
        n_out = writer.count
    ledger.write()
    return {**ledger.check(n_in, n_out, unique=False), "sources": per_source}


def _signatures(rs: ResolvedSource, unit: Unit) -> list[tuple[int, int] | None]:
    """Size and mtime of each file of a unit (None: gone)."""
    out = []
    for path in rs.files[unit.files[0] : unit.files[1]]:
        try:
            st = path.stat()
            out.append((st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return out


def _changed(rs: ResolvedSource, unit: Unit, before: list) -> list[str]:
    """The files of a unit that changed or vanished while it was read, each with a warning: what was read
    of them is in the artifact (every record accounted for), but a rerun may read something else."""
    after = _signatures(rs, unit)
    names = [_name(p, rs.root) for p, b, a in zip(rs.files[unit.files[0] : unit.files[1]], before, after,
                                                    strict=True) if a != b]
    for name in names:
        log.warning("source %r: %s changed while it was read: rerun ingest once it is stable", rs.config.name,
                    name)
    return names


def merge(sources, prior: dict[str, list[Path]], out: Path) -> dict:
    """Join the shards in rank order. An id read twice (a repeated `id_field` value) keeps its first record
    in corpus order: a later one is quarantined `duplicate_id` if it was kept, and its ledger id gets `@<n>`
    appended (n: its place among all the records read), so ledger ids stay unique."""
    parts = prior["shard"]
    repeated = ledgers.repeated([ledgers.id_hashes(part) for part in parts])
    per_source: dict[str, dict] = {}
    for part in parts:
        for name, s in json.loads((part / "manifest.json").read_text())["stats"]["sources"].items():
            total = per_source.setdefault(name, s)
            if total is not s:
                for field in ("files", "documents", "kept", "quarantined", "bytes", "changed"):
                    total[field] += s[field]
    stats = _rejoin(parts, out, repeated, per_source) if repeated else join(parts, out, "ingest")
    return {**stats, "sources": per_source, "shards": len(parts)}


def _rejoin(parts: list[Path], out: Path, repeated: set[int], per_source: dict[str, dict]) -> dict:
    """`join`, resolving the ids whose hashes are in `repeated` (see `merge`) one shard at a time."""
    ledger, seen, n = Ledger("ingest", out), set(), 0
    with DocWriter(out) as writer:
        for part in parts:
            docs = iter_docs(part)
            rows = ledgers.read(part).to_pydict().values()
            for doc_id, fate, reason, detail in zip(*rows, strict=True):
                n += 1
                doc = next(docs) if fate == "kept" else None
                if xxhash.xxh3_64_intdigest(doc_id) in repeated:
                    if doc_id in seen:
                        if doc is not None:
                            fate, reason = "quarantined", "duplicate_id"
                            detail = f"id {doc_id!r} already used"
                            log.warning("source %r: %s quarantined: %s", doc["source"], doc_id, detail)
                            _unkeep(per_source[doc["source"]], doc)
                            doc = None
                        doc_id = f"{doc_id}@{n}"
                    seen.add(doc_id)
                ledger.add(doc_id, fate, reason, detail)
                if doc is not None:
                    writer.write(doc)
        n_out = writer.count
    ledger.write()
    return ledger.check(n, n_out)


def _unkeep(stats: dict, doc: dict) -> None:
    stats["kept"] -= 1
    stats["quarantined"] += 1
    stats["bytes"] -= len(doc["text"].encode("utf-8"))


def run(sources: list[ResolvedSource], out: Path, shards: int = 1) -> dict:
    """The whole stage in one process (tests, benchmarks): every shard, then `merge`, into `out`."""
    plan, parts = units(sources), []
    with tempfile.TemporaryDirectory(dir=out, prefix=".shards") as tmp:
        for rank in range(shards):
            part = Path(tmp) / str(rank)
            part.mkdir()
            stats = read(sources, assign(plan, (rank, shards)), part)
            (part / "manifest.json").write_text(json.dumps({"stats": stats}))
            parts.append(part)
        return merge(None, {"shard": parts}, out)
