"""A file as a stream of lines, never held whole: decompressed chunks (.gz, .zst, raw) of bounded size, a file
expanding past its source's bound stopped (`Bound`: a decompression bomb), lines cut from the chunks, a line over
the reader's limit dropped as it comes (`Overlong`), and a read error mid-file carrying the line it cut
(`LineCut`) so that line is accounted for, not lost.

Readers call `lines.chunks` and read `lines.CHUNK` through the module, so a test can swap either."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import zstandard

from moeflow.ingest.errors import READ_ERRORS, DecompressionBomb, why

CHUNK = 1 << 20
FLOOR = 1 << 20  # decompressed bytes a file may reach whatever its ratio: a small file is never a bomb
COMPRESSED = (".gz", ".zst")  # decompressed as they are read, by extension
# compressed bytes a zstd decompress call is given: zstd's densest block (a 3-byte header and one byte) stands for
# 128 KiB, so a call returns at most about 16 MiB whatever the file expands to (feeding 1 MB a call, a 16 KB file
# came back as one 512 MB chunk)
ZSTD_STEP = 512


@dataclass(frozen=True)
class Bound:
    """How far a compressed file may expand before it is a decompression bomb: `ratio` decompressed bytes for each
    compressed byte read (checked once the output passes `FLOOR`), and `size`
    decompressed bytes in all (None: no cap). A source's bound is its `max_expansion` and
    `max_decompressed_bytes`."""

    ratio: float = 100.0
    size: int | None = None

    @classmethod
    def of(cls, src) -> Bound:
        return cls(src.max_expansion, src.max_decompressed_bytes)

    def room(self, read: int) -> int:
        """The decompressed bytes allowed from `read` compressed ones."""
        room = max(FLOOR, int(self.ratio * read))
        return room if self.size is None else min(room, self.size)

    def check(self, out: int, read: int, path: Path) -> None:
        """Raise `DecompressionBomb` for `path` if `out` decompressed bytes from `read` compressed ones exceed it."""
        if out <= self.room(read):
            return
        if self.size is not None and out > self.size:
            raise DecompressionBomb(f"{path.name} expands past {self.size:,} bytes, the source's "
                                    "max_decompressed_bytes; raise it for this source if the file is genuine")
        raise DecompressionBomb(
            f"{path.name} expands past {out:,} bytes from {read:,} compressed ({out / max(read, 1):,.0f}x, over "
            f"the source's max_expansion of {self.ratio:g}x); raise max_expansion for this source if the file is "
            "genuine")


def chunks(path: Path, bound: Bound = Bound()) -> Iterator[bytes]:
    """A file's decompressed bytes (by extension: .gz, .zst, else raw) in chunks of at most `CHUNK` bytes, so no
    source file is ever held whole; a compressed file expanding past `bound` raises `DecompressionBomb` once the
    bytes up to the bound are yielded. A file cut inside a zstd frame raises EOFError (zstandard's stream reader
    would end quietly); gzip raises EOFError itself. Every byte decoded before a read error is yielded before it
    is raised: unbuffered reads, and gzip's `read1` (its `read` drops the bytes it decoded in the call that
    fails)."""
    with open(path, "rb", buffering=0) as f:
        if path.suffix not in COMPRESSED:
            while chunk := f.read(CHUNK):
                yield chunk
            return
        out = 0
        for chunk in _gunzip(f) if path.suffix == ".gz" else _unzstd(f):
            room = bound.room(f.tell()) - out
            for at in range(0, min(len(chunk), room), CHUNK):
                yield chunk[at : min(at + CHUNK, room)]
            out += len(chunk)
            bound.check(out, f.tell(), path)


def _gunzip(f: BinaryIO) -> Iterator[bytes]:
    with gzip.open(f) as g:
        while chunk := g.read1(CHUNK):
            yield chunk


def _unzstd(f: BinaryIO) -> Iterator[bytes]:
    """Every frame of a zstd file in turn (a file may hold several, e.g. files concatenated), decompressed
    `ZSTD_STEP` compressed bytes at a time."""
    d, open_frame = zstandard.ZstdDecompressor().decompressobj(), False
    while raw := f.read(CHUNK):
        view = memoryview(raw)
        for at in range(0, len(raw), ZSTD_STEP):
            piece = view[at : at + ZSTD_STEP]
            while piece:
                out = d.decompress(piece)
                open_frame = True
                if out:
                    yield out
                if d.eof:  # a frame ended: the rest starts the next one
                    piece, open_frame = d.unused_data, False
                    d = zstandard.ZstdDecompressor().decompressobj()
                else:
                    piece = b""
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
        """The line's first 64 bytes (joining every piece would copy a line as long as the limit)."""
        out = b""
        for piece in self.pieces:
            if len(out) >= 64:
                break
            out += piece[: 64 - len(out)]
        return out

    def take(self) -> bytes | Overlong:
        line = Overlong(self.size) if self.over else b"".join(self.pieces)
        self.pieces, self.size, self.over = [], 0, False
        return line
