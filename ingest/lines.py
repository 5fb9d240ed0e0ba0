"""A file as a stream of lines, never held whole: decompressed chunks (.gz, .zst, raw), lines cut from them,
a line over the reader's limit dropped as it comes (`Overlong`), and a read error mid-file carrying the line
it cut (`LineCut`) so that line is accounted for, not lost.

Readers call `lines.chunks` and read `lines.CHUNK` through the module, so a test can swap either."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import zstandard

from moeflow.ingest.errors import READ_ERRORS, why

CHUNK = 1 << 20


def chunks(path: Path) -> Iterator[bytes]:
    """A file's decompressed bytes (by extension: .gz, .zst, else raw) in chunks of about 1 MB, so no
    source file is ever held whole. A file cut inside a zstd frame raises EOFError (zstandard's stream
    reader would end quietly); gzip raises EOFError itself. Every byte decoded before a read error is
    yielded before it is raised: unbuffered reads, and gzip's `read1` (its `read` drops the bytes it
    decoded in the call that fails)."""
    with open(path, "rb", buffering=0) as f:
        if path.suffix == ".gz":
            yield from _gunzip(f)
        elif path.suffix == ".zst":
            yield from _unzstd(f)
        else:
            while chunk := f.read(CHUNK):
                yield chunk


def _gunzip(f: BinaryIO) -> Iterator[bytes]:
    with gzip.open(f) as g:
        while chunk := g.read1(CHUNK):
            yield chunk


def _unzstd(f: BinaryIO) -> Iterator[bytes]:
    """Every frame of a zstd file in turn (a file may hold several, e.g. files concatenated)."""
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


class LineCut(Exception):
    """A read error part-way through a line stream: the error, the bytes of the line it cut (b"" when it
    fell between lines), and the number of the last line read (set by `jsonl.parsed`; the cut one
    included)."""

    def __init__(self, error: Exception, partial: bytes, size: int | None = None):
        super().__init__(why(error))
        self.error, self.partial, self.line = error, partial, 0
        self.size = len(partial) if size is None else size  # the cut line's bytes (`partial`: its head)


class Overlong:
    """A line longer than the reader's limit: its bytes were dropped as they came (`size` counts them), so
    one line never holds more memory than the limit."""

    def __init__(self, size: int):
        self.size = size


def split(stream: Iterator[bytes], limit: int | None = None) -> Iterator[bytes | Overlong]:
    """Complete lines of a chunk stream, a line over `limit` bytes as an `Overlong`; a read error mid-file
    comes out after the lines before it, as a `LineCut` holding the line it cut short (so that line can be
    accounted for, not lost)."""
    line = _Line(limit)  # the current line's pieces (a long line spans many chunks)
    try:
        for chunk in stream:
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
