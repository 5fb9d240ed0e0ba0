"""The one stage runner: keys any declared stage, builds it in a staging folder, checks, records and commits it.

A stage is declared once, in its package's `stages.py`: the config slice its body receives, its body (a
plain function of that package: `body(slice, inputs, out)`), the libraries that shape its output and the
files it reads from outside the store. The key is derived from that declaration alone (`lineage.keys`):
the slice less its operational fields, the normalised code of the modules the body reaches, those
libraries' versions, the fetched files' identities and the inputs' content hashes. Reuse is decided
by the store alone: a stage whose artifact is there returns its manifest at once (`tasks/pipeline.py`
wraps this in Prefect tasks). Prefect caches and
persists nothing (its results are pickles; a store that others can write must never run code).
A sharded stage runs as phases of tasks on the configured runner (record shards, or partitions of a
distributed reduce), each part its own artifact, keyed by the parts it reads, then joined.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import shutil
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from moeflow.configs import RunConfig
from moeflow.core import faults
from moeflow.core.ledger import ConservationError
from moeflow.core.stage import Phase, Stage
from moeflow.lineage import code, keys, openlineage, record
from moeflow.store.local import Manifest, Store
from moeflow.store.url import store_for
from moeflow.tasks.registry import STAGES

log = logging.getLogger(__name__)
Inputs = dict[str, Manifest]


class StoreFull(OSError):
    """A stage could not write its artifact: the disk (or the file-size limit) is full.

    Nothing was published.
    """


Part = tuple[str, int, int]  # (phase, index, count): one part of a sharded stage
Prior = dict[str, list[Manifest]]  # earlier phases' parts, by phase name


def key_parts(
    stage: Stage,
    cfg: RunConfig,
    inputs: dict[str, str | None],
    part: Part | None = None,
    prior: dict[str, list[str]] | None = None,
    fanout: dict[str, int] | None = None,
    fetched: dict | None = None,
) -> dict:
    """The five parts of a stage's key (`lineage.keys`); `inputs` are the inputs' content hashes, `fetched` the
    identities a planning phase recorded (None: the stage's own `fetched`, listed now).

    A part of a sharded stage adds its place, every phase's part count (`fanout`) and the content hashes
    of the earlier phases' parts it reads."""
    slice_ = stage.config(cfg)
    libraries = stage.libraries(slice_) if callable(stage.libraries) else stage.libraries
    parts = {
        "config": keys.keyed(slice_),
        "code": code.closure(stage.module),
        "libraries": code.libraries(libraries),
        "fetched": fetched if fetched is not None else stage.fetched(slice_) if stage.fetched else {},
        "inputs": dict(sorted(inputs.items())),
    }
    if part is not None:
        parts["part"] = list(part)
        parts["fanout"] = fanout or {}
        parts["prior"] = prior or {}
    return parts


def artifact_name(stage: Stage, part: Part | None = None) -> str:
    return f"{stage.name}.{part[0]}" if part is not None else stage.name


def _hashes(prior: Prior | None) -> dict[str, list[str]]:
    return {name: [m.content_hash for m in ms] for name, ms in (prior or {}).items()}


def artifact_key(stage: Stage, cfg: RunConfig, inputs: Inputs, part: Part | None = None,
                 prior: Prior | None = None) -> str:
    return keys.digest(artifact_name(stage, part), _key_record(stage, cfg, inputs, part, prior))


def _key_record(stage: Stage, cfg: RunConfig, inputs: Inputs, part: Part | None, prior: Prior | None) -> dict:
    fanout = stage.fanout(cfg, inputs) if part is not None else None
    return key_parts(stage, cfg, {k: v.content_hash for k, v in inputs.items()}, part, _hashes(prior), fanout,
                     fetched=_planned(stage, prior))


def _planned(stage: Stage, prior: Prior | None) -> dict | None:
    """The fetched identities the stage's planning phase recorded (`Phase.plans`), once it has run."""
    first = stage.phases[0] if stage.phases else None
    if first is None or not first.plans or not (prior or {}).get(first.name):
        return None
    return prior[first.name][0].lineage()["key"]["fetched"]


def materialize(
    stage_name: str,
    cfg: RunConfig,
    inputs: Inputs,
    *,
    force: bool = False,
    part: Part | None = None,
    prior: Prior | None = None,
) -> Manifest:
    """Return the stage's artifact, building it unless it is in the store already (or `force`).

    `part`: build one part of a sharded stage's phase from the earlier phases' parts (`prior`); `prior`
    alone: build the stage by joining its phases' parts."""
    stage = STAGES[stage_name]
    store = store_for(cfg.store_url())
    name = artifact_name(stage, part)
    key_record = _key_record(stage, cfg, inputs, part, prior)
    key = keys.digest(name, key_record)
    existing = store.get(name, key)
    if existing is not None and not force:
        log.info("%s: reusing %s", name, existing.path)
        return existing
    if stage.body is None and part is None and prior is None:  # called on its own: the phases, here
        prior = _phases_here(stage, cfg, inputs, force)
    with store.lock(name, key):  # a concurrent run building the same artifact: wait for it, then reuse
        existing = store.get(name, key)
        if existing is not None and not force:
            log.info("%s: reusing %s (built by a concurrent run)", name, existing.path)
            return existing
        phase = part[0] if part is not None else "join" if prior else None
        with faults.building(stage.name, phase, part[1] if part is not None else None):
            manifest = _build(stage, name, key, key_record, store, cfg, inputs, part, prior)
            faults.at("committed")
    openlineage.emit(store.root, manifest.lineage())
    log.info("%s: wrote %s", name, manifest.path)
    return manifest


def run_phases(stage: Stage, cfg: RunConfig, inputs: Inputs,
               build_phase: Callable[[Phase, int, Prior], list[Manifest]]) -> Prior:
    """The one loop over a sharded stage's phases, in order: `build_phase(phase, n, prior)` builds a phase's n
    parts from the earlier phases' parts (here, one after another; in `Pipeline`, as concurrent tasks) and
    returns their manifests in part order. Returns every phase's parts, for the join."""
    prior: Prior = {}
    for phase in stage.phases:
        prior[phase.name] = build_phase(phase, phase.parts(cfg, inputs), dict(prior))
    return prior


def _phases_here(stage: Stage, cfg: RunConfig, inputs: Inputs, force: bool) -> Prior:
    def build_phase(phase: Phase, n: int, prior: Prior) -> list[Manifest]:
        return [materialize(stage.name, cfg, inputs, force=force, part=(phase.name, r, n), prior=prior)
                for r in range(n)]

    return run_phases(stage, cfg, inputs, build_phase)


def _run_body(
    stage: Stage,
    cfg: RunConfig,
    inputs: Inputs,
    tmp: Path,
    work: Path | None,
    part: Part | None,
    prior: Prior | None,
) -> dict:
    slice_ = stage.config(cfg)
    dirs = {name: [m.dir for m in ms] for name, ms in (prior or {}).items()}
    if part is not None:
        phase = next(p for p in stage.phases if p.name == part[0])
        return phase.body(slice_, inputs, dirs, tmp, part=part[1:])
    if prior:
        stats = stage.merge(slice_, dirs, tmp)
    else:
        stats = stage.body(slice_, inputs, tmp, work) if stage.resumable else stage.body(slice_, inputs, tmp)
    check_conservation(stage, inputs, stats)
    return stats


def check_conservation(stage: Stage, inputs: Inputs, stats: dict) -> None:
    """A stage that reads all of an input (`Stage.reads`) must record as many as that input recorded
    (`Stage.counts`: its documents out, or a mix's held-out rows and documents, domain by domain)."""
    source = inputs.get(stage.reads) if stage.reads else None
    if source is None:
        return
    for mine, theirs, what in stage.counts:
        if mine not in stats:
            raise ConservationError(f"stage {stage.name} reads its {stage.reads!r} input but recorded no {mine}")
        read, written = stats[mine], source.stats.get(theirs)
        if read is None:  # it read none, by its config (a tokenizer not trained here)
            continue
        if written is None:
            raise ConservationError(f"stage {stage.name}: its input {source.stage}-{source.hash} recorded no "
                                    f"{theirs} to check its count against")
        of = ""
        if isinstance(read, dict):  # by domain: the first that differs names the counts (one absent is 0)
            differ = [k for k in sorted(read.keys() | written.keys()) if read.get(k, 0) != written.get(k, 0)]
            if not differ:
                continue
            of, read, written = f" of domain {differ[0]!r}", read.get(differ[0], 0), written.get(differ[0], 0)
        if read != written:
            raise ConservationError(
                f"stage {stage.name}: read {read} {what}{of}, but its input {source.stage}-{source.hash} "
                f"recorded {written} (its {theirs})"
            )


def _lineage(stage: Stage, name: str, cfg: RunConfig, inputs: Inputs, store: Store, parts: dict) -> dict:
    return {
        "stage": name,
        "key": parts,
        "config": parts["config"],
        "operational": keys.operational(stage.config(cfg)),
        "run_config": cfg.name,
        "inputs": {
            k: {
                "stage": v.stage,
                "hash": v.hash,
                "content_hash": v.content_hash,
                "path": relpath(v),
            }
            for k, v in sorted(inputs.items())
        },
        "code": {
            **record.code_version(),
            "source_hash": keys.digest("code", parts["code"]),
            "libraries": parts["libraries"],
        },
        "prefect": record.prefect_context(),
        "previous": _previous(store, name) if "part" not in parts else None,
    }


def _previous(store: Store, name: str) -> dict | None:
    """The newest earlier artifact of this stage in the store: the lineage report diffs configs against it.
    Not looked up for a part of a sharded stage: its newest other part is a sibling shard, never diffed, and
    each part reading every earlier part's record made a stage of n parts read n²/2 of them."""
    prev = store.newest(name)
    return {"artifact": f"{name}-{prev['artifact']['hash']}", "config": prev["config"]} if prev else None


def _build(
    stage: Stage,
    name: str,
    key: str,
    key_record: dict,
    store: Store,
    cfg: RunConfig,
    inputs: Inputs,
    part: Part | None,
    prior: Prior | None,
) -> Manifest:
    """Verify the inputs, run the stage body in a staging folder, and commit the artifact atomically."""
    earlier = [m for ms in (prior or {}).values() for m in ms]
    reads = [m for _, m in sorted(inputs.items())] + earlier
    for manifest in reads:  # a flipped byte or a cut file upstream fails here, named
        manifest.verify()
    faults.at("inputs")
    lineage = _lineage(stage, name, cfg, inputs, store, key_record)
    tmp = store.staging(name)
    work = store.folder(name, key).with_name(f".{name}-{key}.work") if stage.resumable else None
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    try:
        with contextlib.ExitStack() as held:  # an input a rerun replaced while the body read it: said so
            for manifest in reads:
                held.enter_context(manifest.reading())
            stats = _run_body(stage, cfg, inputs, tmp, work, part, prior)
        faults.at("written")
        lineage.update(
            {
                "started_at": started.isoformat(timespec="seconds"),
                "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "seconds": round(time.perf_counter() - t0, 2),
                "stats": stats,
                "host": record.host(),  # after the body: a training body imported torch; it names the GPU
            }
        )
        if part is not None:
            lineage["part"] = list(part)
        elif prior:
            lineage["phases"] = {name: [_ref(m) for m in ms] for name, ms in prior.items()}
            lineage["shards"] = lineage["phases"][stage.phases[-1].name]
            lineage.update(_timing(earlier, lineage))
        manifest = store.commit(name, key, tmp, stats, lineage)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise StoreFull(
                f"{name}: the artifact store ran out of space ({e.strerror}: {e.filename or tmp}); "
                f"nothing was published. Free space under {store.root} (or set MOEFLOW_STORE to a "
                f"larger disk) and run again: finished stages are reused."
            ) from e
        raise
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)
    return manifest


def _timing(parts: list[Manifest], joined: dict) -> dict:
    """A sharded stage's time, from its parts' records: `wall_seconds` from the first part's start to the
    join's end (what a user waited), `parts_seconds` the parts' own seconds summed (the work, on however
    many workers); `seconds` stays the join's own."""
    records = [m.lineage() for m in parts]
    first = min(datetime.fromisoformat(r["started_at"]) for r in records)
    return {"wall_seconds": round((datetime.fromisoformat(joined["finished_at"]) - first).total_seconds(), 2),
            "parts_seconds": round(sum(r["seconds"] for r in records), 2)}


def relpath(m: Manifest) -> str:
    """Where an artifact is, relative to its store's root (the same in a local store and an object store)."""
    return f"{m.stage}/{m.name}"


def _ref(m: Manifest) -> dict:
    return {"hash": m.hash, "content_hash": m.content_hash, "path": relpath(m)}
