"""Sources resolved to the files they name, before any work: a source that matches nothing fails the run
with a message naming the source, and each match left out (a link to a file already listed, a FIFO) is
noted with why."""

from __future__ import annotations

import fnmatch
import glob
import logging
import stat
from dataclasses import dataclass
from pathlib import Path

from moeflow.configs import Format, RunConfig, SourceConfig
from moeflow.ingest import hf
from moeflow.ingest.errors import SourceError
from moeflow.ingest.names import relative_name
from moeflow.sources import fetch, registry

log = logging.getLogger(__name__)


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
        if any(fnmatch.fnmatch(relative_name(path, root), x) for x in exclude):
            continue
        try:
            st = path.stat()
        except OSError as e:
            skipped.append(f"{relative_name(path, root)}: {e.strerror}")
            continue
        if stat.S_ISDIR(st.st_mode):
            continue
        if not stat.S_ISREG(st.st_mode):
            skipped.append(f"{relative_name(path, root)}: not a regular file")
        elif (st.st_dev, st.st_ino) in seen:
            skipped.append(
                f"{relative_name(path, root)}: the same file as {relative_name(seen[st.st_dev, st.st_ino], root)}"
            )
        else:
            seen[st.st_dev, st.st_ino] = path
            files.append(path)
    return files, skipped


def preflight(cfg: RunConfig) -> None:
    """Before any work: user sources must match files, package sources must name known packages."""
    for src in cfg.sources:
        if src.package:
            try:
                registry.get(src.package)
            except KeyError as e:
                raise SourceError(f"source {src.name!r}: {e.args[0]}") from None
        else:
            resolve_source(src)


def resolve_sources(cfg: RunConfig) -> list[ResolvedSource]:
    """Resolve every source before any work; raise on the first that matches nothing."""
    return resolve_sources_list(cfg.sources)


def resolve_sources_list(sources) -> list[ResolvedSource]:
    return [r for r in (resolve_source(s) for s in sources) if r is not None]
