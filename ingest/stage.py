"""The `ingest` stage body: `plan_part` lists the sources' files once and cuts them into units, each shard reads its
units of that plan into documents and a ledger (`shard`, `read`), and `merge` joins the shards in rank order,
resolving ids read twice. `tasks.runner` runs them, as it runs every sharded stage."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

import xxhash

from moeflow.configs import SourceConfig
from moeflow.core import faults, progress
from moeflow.core import ledger as ledgers
from moeflow.core.documents import DocWriter, iter_docs, join
from moeflow.core.ledger import Ledger
from moeflow.core.paths import stat_identity
from moeflow.core.progress import tqdm
from moeflow.ingest.names import portable, relative_name
from moeflow.ingest.plan import Unit, assign, units
from moeflow.ingest.reader import records
from moeflow.ingest.records import utf8_size
from moeflow.ingest.resolve import ResolvedSource, resolve_sources_list

log = logging.getLogger(__name__)
# A shard's documents file is written uncompressed: the join alone reads it, once, and writes the compressed
# file (compressing every text twice, in the shard and again in the join, and decompressing it between took
# 0.15-0.3 s of a 16-shard ingest's ~1 s). A shard's files take about 2.5 times the joined file's disk.
PART_COMPRESSION = "none"


def _source_stats(rs: ResolvedSource) -> dict:
    src = rs.config
    return {"files": 0, "documents": 0, "kept": 0, "quarantined": 0, "bytes": 0, "version": rs.version,
            "package": src.package, "license": src.license, "domain": src.domain,
            "skipped_paths": len(rs.skipped), "skipped": list(rs.skipped[:20]), "changed": []}


PLAN = "plan.json"


def plan_part(sources: tuple[SourceConfig, ...], inputs: dict, prior: dict, out: Path, part: tuple[int, int]
              ) -> dict:
    """The `ingest` stage's plan, made once a run: every source's files as listed now and their units, in
    `plan.json`; the shards read this, so no two parts list the sources at different moments (a file deleted
    while one shard read it once failed the next, which listed the source again)."""
    resolved = resolve_sources_list(sources)
    listing = [{"name": rs.config.name, "root": str(rs.root), "files": [str(f) for f in rs.files],
                "version": rs.version, "skipped": list(rs.skipped)} for rs in resolved]
    cut = [asdict(u) for u in units(resolved)]
    (out / PLAN).write_text(json.dumps({"sources": listing, "units": cut}))
    return {"sources": len(resolved), "files": sum(len(rs.files) for rs in resolved), "units": len(cut)}


def shard(sources: tuple[SourceConfig, ...], inputs: dict, prior: dict, out: Path,
          part: tuple[int, int]) -> dict:
    """One shard of the `ingest` stage: its units (`assign`) of the plan."""
    planned = json.loads((prior["plan"][0] / PLAN).read_text())
    by_name = {s.name: s for s in sources}
    resolved = [ResolvedSource(config=by_name[s["name"]], root=Path(s["root"]), files=tuple(map(Path, s["files"])),
                               version=s["version"], skipped=tuple(s["skipped"])) for s in planned["sources"]]
    cut = [Unit(**{k: tuple(v) if isinstance(v, list) else v for k, v in u.items()}) for u in planned["units"]]
    return read(resolved, assign(cut, part), out)


def read(sources: list[ResolvedSource], mine: list[Unit], out: Path) -> dict:
    """Write the documents and ledger of the units `mine` into `out`; return stats (per source and fate).
    Ids are checked for repeats across the whole corpus by `merge`: here a repeated id stays as read."""
    ledger = Ledger("ingest", out)
    per_source: dict[str, dict] = {}
    names: dict[Path, str] = {}  # a file's lineage name, resolved once, not once a record
    n_in = 0
    with DocWriter(out, compression=PART_COMPRESSION) as writer, tqdm(
            total=sum(u.size for u in mine), desc=progress.task_name("ingest"), unit="B", unit_scale=True,
            mininterval=5) as bar:
        for unit in mine:
            bar.update(unit.size)  # as it starts: a unit is read whole
            rs = sources[unit.source]
            stats = per_source.setdefault(rs.config.name, _source_stats(rs))
            if unit.first:  # a file is counted by the shard reading its start
                stats["files"] += unit.files[1] - unit.files[0]
            before = _signatures(rs, unit)
            for doc_id, path, text, q in records(rs, unit):
                n_in += 1
                stats["documents"] += 1
                if q is not None:
                    log.warning("source %r: %s (%s) quarantined: %s", rs.config.name, path, doc_id, q)
                    ledger.add(doc_id, "quarantined", q.reason, q.detail)
                    stats["quarantined"] += 1
                    continue
                data = text.encode("utf-8")  # once: the text's size and what its column holds
                writer.write({"id": doc_id, "source": rs.config.name, "domain": rs.config.domain,
                              "path": names.get(path) or names.setdefault(path, portable(path)), "text": data})
                ledger.kept(doc_id)
                stats["kept"] += 1
                stats["bytes"] += len(data)
            stats["changed"] += _changed(rs, unit, before)
            faults.reached(bar.n, bar.total)  # `make chaos`: a kill point by bytes read
        n_out = writer.count
    ledger.write()
    return {**ledger.check(n_in, n_out, unique=False), "sources": per_source}


def _signatures(rs: ResolvedSource, unit: Unit) -> list[tuple[int, ...] | None]:
    """The `stat_identity` of each file of a unit (None: gone)."""
    out = []
    for path in rs.files[unit.files[0] : unit.files[1]]:
        try:
            out.append(stat_identity(path.stat()))
        except OSError:
            out.append(None)
    return out


def _changed(rs: ResolvedSource, unit: Unit, before: list) -> list[str]:
    """The files of a unit that changed or vanished while it was read, each with a warning: what was read
    of them is in the artifact (every record accounted for), but a rerun may read something else."""
    after = _signatures(rs, unit)
    names = [relative_name(p, rs.root) for p, b, a in zip(rs.files[unit.files[0] : unit.files[1]], before,
                                                           after, strict=True) if a != b]
    for name in names:
        log.warning("source %r: %s changed while it was read: rerun ingest once it is stable", rs.config.name,
                    name)
    return names


def merge(sources, prior: dict[str, list[Path]], out: Path) -> dict:
    """Join the shards in rank order. An id read twice (a repeated `id_field` value) keeps its first record
    in corpus order: a later one is quarantined `duplicate_id` if it was kept, and its ledger id gets `@<n>`
    appended (n: its place among all the records read), so ledger ids stay unique."""
    parts = prior["shard"]
    repeated = ledgers.repeated([ledgers.id_hashes(part) for part in parts])
    per_source: dict[str, dict] = {}
    for part in parts:
        for name, s in json.loads((part / "manifest.json").read_text())["stats"]["sources"].items():
            total = per_source.setdefault(name, s)
            if total is not s:
                for field in ("files", "documents", "kept", "quarantined", "bytes", "changed"):
                    total[field] += s[field]
    stats = _rejoin(parts, out, repeated, per_source) if repeated else join(parts, out, "ingest", copy=False)
    return {**stats, "sources": per_source, "shards": len(parts)}


def _rejoin(parts: list[Path], out: Path, repeated: set[int], per_source: dict[str, dict]) -> dict:
    """`join`, resolving the ids whose hashes are in `repeated` (see `merge`) one shard at a time."""
    ledger, seen, n = Ledger("ingest", out), set(), 0
    with DocWriter(out) as writer:
        for part in parts:
            docs = iter_docs(part)
            rows = ledgers.read(part).to_pydict().values()
            for doc_id, fate, reason, detail in zip(*rows, strict=True):
                n += 1
                doc = next(docs) if fate == "kept" else None
                if xxhash.xxh3_64_intdigest(doc_id) in repeated:
                    if doc_id in seen:
                        if doc is not None:
                            fate, reason = "quarantined", "duplicate_id"
                            detail = f"id {doc_id!r} already used"
                            log.warning("source %r: %s quarantined: %s", doc["source"], doc_id, detail)
                            _unkeep(per_source[doc["source"]], doc)
                            doc = None
                        doc_id = f"{doc_id}@{n}"
                    seen.add(doc_id)
                ledger.add(doc_id, fate, reason, detail)
                if doc is not None:
                    writer.write(doc)
        n_out = writer.count
    ledger.write()
    return ledger.check(n, n_out)


def _unkeep(stats: dict, doc: dict) -> None:
    stats["kept"] -= 1
    stats["quarantined"] += 1
    stats["bytes"] -= utf8_size(doc["text"])

