"""The xxh3 of the files a local source lists, kept in the data cache so that a file whose stat is as it was
is not read again to key a stage.

An entry is keyed by the file's `stat_identity` (device, inode, size, mtime, ctime), so a file rewritten in
place, its size kept and its mtime set back, is hashed anew. A file changed less than `SETTLED_NS` before it
is hashed gets no entry: a second change within its timestamp's tick would leave its stat as it was (git's
"racy clean" files). Each source has a table of its own, `<cache>/hashes/<xxh3 of its path pattern>.json`,
holding the files it listed last. A table is replaced whole through a scratch file, so processes keying at
once never read half of one; a table that cannot be read is rebuilt, one that cannot be written is skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import xxhash

from moeflow.core.paths import cache_dir, stat_identity
from moeflow.store.format import file_xxh3

SETTLED_NS = 2 * 10**9  # longer than any local filesystem's timestamp tick (FAT's is 2 s)


def identities(files: Sequence[Path], table: str) -> list[dict]:
    """Each file's size and xxh3 (both None for a file gone or unreadable since it was listed: ingest
    quarantines it, naming why), read from the table named `table` where the file's stat is as recorded."""
    path = cache_dir() / "hashes" / f"{xxhash.xxh3_64_hexdigest(table)}.json"
    known, kept, out = _read(path), {}, []
    settled = time.time_ns() - SETTLED_NS  # before any stat: a file changed after it has a later ctime
    for f in files:
        try:
            st = f.stat()
            entry = ":".join(map(str, stat_identity(st)))
            digest = known.get(entry)
            if not isinstance(digest, str):
                digest = file_xxh3(f)
        except OSError:
            out.append({"size": None, "xxh3": None})
            continue
        if st.st_ctime_ns <= settled:
            kept[entry] = digest
        out.append({"size": st.st_size, "xxh3": digest})
    if kept != known:
        _write(path, kept)
    return out


def _read(path: Path) -> dict:
    """The table at `path`; empty when there is none or it cannot be read."""
    try:
        table = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _write(path: Path, table: dict) -> None:
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(json.dumps(table))
        os.replace(tmp, path)
