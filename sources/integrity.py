"""A fetched package's extracted tree, checked against what was recorded when it was fetched.

The archive's sha256 is checked at fetch; the files stages read are the extracted tree, which a user or a
tool can change afterwards. The receipt records the tree's digest (xxh3 over each file's path, size and
bytes) and a cheap stat signature (each file's path, device, inode, size, mtime and ctime: an in-place
rewrite that keeps the size and sets the mtime back still changes the ctime); a check reads the stat
signature and hashes the bytes again only when that differs (a file touched or copied but unchanged passes,
and the receipt takes the new signature).
"""

from __future__ import annotations

import os
from pathlib import Path

import xxhash

from moeflow.core.paths import stat_identity

CHUNK = 1 << 20


def _entries(root: Path) -> list[tuple[str, os.stat_result]]:
    """Every file under `root`: (relative path, stat), sorted by path."""
    out, todo = [], [str(root)]
    while todo:
        with os.scandir(todo.pop()) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    todo.append(e.path)
                elif e.is_file():
                    out.append((os.path.relpath(e.path, root), e.stat()))
    return sorted(out, key=lambda x: x[0])


def stat_signature(root: Path) -> str:
    h = xxhash.xxh3_64()
    for rel, st in _entries(root):
        h.update(f"{rel}\0{stat_identity(st)}\n".encode())
    return h.hexdigest()


def content_digest(root: Path) -> str:
    h = xxhash.xxh3_128()
    for rel, st in _entries(root):
        h.update(f"{rel}\0{st.st_size}\n".encode())
        with open(root / rel, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
    return h.hexdigest()


def record(root: Path) -> dict:
    """What a receipt keeps of a tree."""
    return {"xxh3": content_digest(root), "stat": stat_signature(root)}


def check(root: Path, recorded: dict) -> dict | None:
    """`recorded` if the tree under `root` is the one it records (its stat signature, or failing that its
    bytes), with the stat signature of now when only that differed; None if the bytes differ."""
    stat = stat_signature(root)
    if stat == recorded["stat"]:
        return recorded
    return {**recorded, "stat": stat} if content_digest(root) == recorded["xxh3"] else None
