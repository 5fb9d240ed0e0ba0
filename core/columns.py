"""Arrow string columns built from Python lists without `pa.array`, which imports pandas to ask whether the list
is a pandas object: 0.4 s and about 50 MB in a data stage's worker, which never uses pandas, on its first
document (`documents.DocWriter`, `ledger.Ledger`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

_OFFSETS = {pa.string(): np.int32, pa.large_string(): np.int64}


def strings(values: list[str | bytes | None], kind: pa.DataType) -> pa.Array:
    """What `pa.array(values, kind)` makes of a list of str and None (`kind`: string or large_string), a str
    also given as its UTF-8 bytes; a str that is not valid Unicode (a lone surrogate) raises
    UnicodeEncodeError, as it fails `pa.array`."""
    data = [_utf8(v) for v in values]
    offsets = np.zeros(len(data) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, data), np.int64, len(data)), out=offsets[1:])
    width = _OFFSETS[kind]
    if offsets[-1] > np.iinfo(width).max:
        raise OverflowError(f"{offsets[-1]:,} bytes of text do not fit one {kind} array; use large_string")
    missing = np.fromiter((v is None for v in values), np.bool_, len(values))
    nulls = int(missing.sum())
    validity = pa.py_buffer(np.packbits(~missing, bitorder="little")) if nulls else None
    buffers = [validity, pa.py_buffer(offsets.astype(width, copy=False)), pa.py_buffer(b"".join(data))]
    return pa.Array.from_buffers(kind, len(values), buffers, null_count=nulls)


def _utf8(value: str | bytes | None) -> bytes:
    """A value's UTF-8; bytes are taken as a str's UTF-8 already (ingest encodes each text once, for its
    size and its column), not checked again."""
    if value is None:
        return b""
    if type(value) is bytes:
        return value
    if type(value) is not str:
        raise TypeError(f"a string column got a {type(value).__name__} ({value!r:.80})")
    return value.encode("utf-8")


def table(columns: dict[str, list], schema: pa.Schema) -> pa.Table:
    """A table of `schema`'s string columns from lists of str and None (`strings`)."""
    return pa.Table.from_arrays([strings(columns[f.name], f.type) for f in schema], schema=schema)
