"""The `sources` stage body: fetch the registry packages a config reads (`moeflow.sources.stage`) and list
its local sources' files as ingest will read them. It lives in ingest because listing a local source is
ingest's (`resolve_source`), and sources sit below ingest.

A local source's files are identified by path, size and the xxh3 of their bytes, so a changed file rebuilds
the stages that read it, even one rewritten in place with its size kept and its mtime set back. The hashes are
kept in the data cache by each file's stat (`sources.hashes`): an unchanged file is not read again.
"""

from __future__ import annotations

import json
from pathlib import Path

from moeflow.configs import Format, RunConfig, SourceConfig
from moeflow.ingest import hf
from moeflow.ingest.resolve import resolve_source
from moeflow.sources import hashes
from moeflow.sources.stage import fetch_packages, packages_for
from moeflow.sources.stage import identities as package_identities


def local_files(sources: tuple[SourceConfig, ...]) -> dict[str, list[dict]]:
    """Each local (not package) source's files with size and xxh3."""
    out = {}
    for src in sources:
        if not src.package:
            files = resolve_source(src).files
            table = str(Path(src.path).expanduser().absolute())  # the source's pattern names its hash table
            out[src.name] = [{"path": str(f), **ident}
                             for f, ident in zip(files, hashes.identities(files, table), strict=True)]
            if src.format == Format.hf_dataset:  # the split's fingerprint, as `datasets` recorded it
                out[src.name].append({"fingerprint": hf.fingerprint(list(files))})
    return out


def identities(packages: list[str] | tuple[str, ...], sources: tuple[SourceConfig, ...] = (),
               reading: bool = True) -> dict:
    """The `fetched` part of a key: `package:NAME` -> version, sha256 and (`reading`) the tree's digest,
    `local:SOURCE` -> its files."""
    out = package_identities(packages, reading)
    out.update({f"local:{name}": files for name, files in local_files(sources).items()})
    return out


def config(cfg: RunConfig) -> dict:
    """The `sources` stage's config slice: what to fetch, which packages may be missing, the local sources."""
    read = (*cfg.sources, *(cfg.quality.positives if cfg.quality else ()))
    optional = sorted({s.package for s in read if s.optional and s.package})
    return {
        "packages": packages_for(cfg),
        "optional": optional,
        "local": [s for s in cfg.sources if not s.package],
    }


def fetched(s: dict) -> dict:
    """The `sources` stage fetches: its key holds what it should fetch, not what the cache holds now."""
    return identities(s["packages"], tuple(s["local"]), reading=False)


def run(s: dict, inputs: dict, out: Path) -> dict:
    """Fetch every package (verifying sha256) and write `packages.json`: versions, checksums, licences."""
    receipts, skipped = fetch_packages(s["packages"], s["optional"])
    local = local_files(tuple(s["local"]))
    record = {"packages": receipts, "skipped": skipped, "local": local}
    (out / "packages.json").write_text(json.dumps(record, indent=2, sort_keys=True))
    return record
