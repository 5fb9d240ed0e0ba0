"""How files are named in ids, warnings and lineage: as text that encodes as UTF-8, whatever bytes a file
name holds (a ledger or a Parquet column cannot hold a lone surrogate)."""

from __future__ import annotations

import os
from pathlib import Path

from moeflow.core.paths import cache_dir


def relative_name(path: Path, root: Path) -> str:
    """A file's path under its source's root as ids name it; bytes that are not UTF-8 as `\\xNN`."""
    return printable(path.relative_to(root).as_posix())


def printable(name: str) -> str:
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


def portable(path: Path) -> str:
    """A raw file's path as lineage records it: `cache:<path in the data cache>` or absolute."""
    try:
        return "cache:" + printable(path.resolve().relative_to(cache_dir()).as_posix())
    except ValueError:
        return printable(str(path.resolve()))
