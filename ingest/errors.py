"""The errors every reader shares, at the bottom so readers and source resolution can all raise them: a source
that cannot be read at all (`SourceError`), and the read errors that cut a file short (`READ_ERRORS`), a
decompression bomb among them."""

from __future__ import annotations

import gzip
import zlib

import pyarrow as pa
import zstandard


class SourceError(ValueError):
    """A source cannot be read at all; the message names the source and the fix."""


class ReadError(Exception):
    """`datasets` failed part-way through a file (a parse error, a broken Arrow file): the records read
    before it stand, the rest of the file is quarantined `unreadable_file` with this message."""


class DecompressionBomb(Exception):
    """A compressed file that expands past its source's `max_expansion` or `max_decompressed_bytes`: reading stops
    there, the records before it stand and the rest of the file is quarantined `decompression_bomb`."""


# zlib.error: corrupt deflate data in a .gz; ArrowInvalid: a parquet file whose footer is unreadable
# ReadError: whatever `datasets` raised part-way through a file
READ_ERRORS = (OSError, EOFError, zlib.error, zstandard.ZstdError, gzip.BadGzipFile, pa.ArrowInvalid,
               ReadError, DecompressionBomb)


def why(e: Exception) -> str:
    """An error as a ledger detail names it (zlib's is called just `error`)."""
    name = type(e).__name__
    return f"{type(e).__module__ + '.' if name == 'error' else ''}{name}: {e}"


def reason(e: Exception) -> str:
    """The quarantine reason for what a read error leaves unread."""
    return "decompression_bomb" if isinstance(e, DecompressionBomb) else "unreadable_file"
