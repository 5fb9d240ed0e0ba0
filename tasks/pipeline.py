"""Runs the flow's stage tasks in order: sharded stages' phases on the configured task runner, `rerun` and
`until`, and a record of what ran.
"""

from __future__ import annotations

import contextlib
import logging
import os
from concurrent.futures.process import BrokenProcessPool

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture
from prefect.task_runners import ProcessPoolTaskRunner

from moeflow.configs import RunConfig
from moeflow.core.stage import Phase, Stage
from moeflow.store.local import Manifest
from moeflow.store.url import store_for
from moeflow.tasks.registry import STAGES
from moeflow.tasks.runner import Inputs, Part, Prior, artifact_key, materialize, run_phases
from moeflow.tokenize import tokenizer

log = logging.getLogger(__name__)


class PoolProcessDied(RuntimeError):
    """A process of a sharded stage's pool died (killed, most likely for memory); the message says which parts
    and which settings make each part smaller."""


def check_stages(rerun, until) -> None:
    unknown = sorted(set(rerun) - set(STAGES)) + ([until] if until and until not in STAGES else [])
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; stages are: {', '.join(STAGES)}")


def _runner(cfg: RunConfig, shards: int):
    """The task runner for shard tasks (`execution` in the config). Processes, not threads: the filters
    hold the GIL, and spaCy's tokenizer (datatrove's word splitter) corrupts its vocabulary when two
    threads share it."""
    ex = cfg.execution
    workers = ex.workers or os.cpu_count() or 1
    if ex.runner == "ray":
        from prefect_ray import RayTaskRunner  # an optional extra (`.[ray]`)

        if ex.ray_address:
            return RayTaskRunner(address=ex.ray_address)
        return RayTaskRunner(init_kwargs={"num_cpus": workers, "include_dashboard": False})
    if ex.runner == "dask":
        from prefect_dask import DaskTaskRunner  # an optional extra (`.[dask]`)

        if ex.dask_address:
            return DaskTaskRunner(address=ex.dask_address)
        return DaskTaskRunner(
            cluster_kwargs={
                "n_workers": min(shards, workers),
                "threads_per_worker": 1,
                "processes": True,
                "dashboard_address": None,
            }
        )
    return ProcessPoolTaskRunner(max_workers=min(shards, workers))


class Pipeline:
    """Runs stage tasks in the order the flow calls them; honours `rerun` and `until`; records what ran."""

    def __init__(self, cfg: RunConfig, rerun: list[str] | tuple[str, ...] = (), until: str | None = None):
        check_stages(rerun, until)
        self.cfg, self.rerun, self.until = cfg, set(rerun), until
        self.done = False
        self.stages: dict[str, dict] = {}
        legacy = cfg.store_path() / ".prefect-results"
        if legacy.exists():
            log.warning("%s holds Prefect result pickles from an older moeflow; they are never read (reuse "
                        "comes from artifact manifests): delete the folder", legacy)

    def subflow(self, flow_, *args):
        """Run a Prefect subflow of stages (the ladder) with this pipeline."""
        return flow_(self, *args)

    def searched(self, cfg: RunConfig, search: Manifest) -> RunConfig:
        """`cfg` with the mixture search's chosen weights in place of the declared ones."""
        return cfg.model_copy(update={"mix": cfg.mix.tilted(search.stats["weights"])})

    def vocab(self, tok: Manifest) -> int:
        return tokenizer.load(tok.dir).get_vocab_size()

    def __call__(self, declared: Stage, *, cfg: RunConfig | None = None, label: str | None = None,
                 **inputs: Manifest) -> Manifest | None:
        """Run the stage (with `cfg` instead of the run's config, e.g. a ladder rung's; recorded as `label`)."""
        if self.done:
            return None
        stage = declared.name
        cfg = cfg or self.cfg
        force = stage in self.rerun
        task_ = TASKS[stage].with_options(task_run_name=label or stage)
        prior = self._phases(stage, cfg, inputs, task_, force, label or stage)
        state = task_(stage, cfg, inputs, force=force, prior=prior, return_state=True)
        manifest = self._record(label or stage, state)
        self.done = stage == self.until
        return manifest

    def _phases(self, stage: str, cfg: RunConfig, inputs: Inputs, task_, force: bool,
                label: str) -> dict[str, list[Manifest]] | None:
        """A sharded stage whose joined artifact is not stored yet: each phase's parts as concurrent tasks
        on the runner (a planning phase in this process), each its own artifact, a phase starting when the one
        before has finished."""
        st = STAGES[stage]
        if not st.phases:
            return None
        if not force and store_for(cfg.store_url()).get(stage, artifact_key(st, cfg, inputs)):
            return None  # (asked before counting the parts: that may read the stage's input)
        if not st.sharded(cfg, inputs):
            return None
        widest = max(st.fanout(cfg, inputs).values())
        with _runner(cfg, widest) if widest > 1 else contextlib.nullcontext() as runner:
            def build_phase(phase: Phase, n: int, prior: Prior) -> list[Manifest]:
                name = label if phase.name == "shard" else f"{label}.{phase.name}"
                states = []
                for r in range(n):
                    one = task_.with_options(task_run_name=f"{name}[{r}/{n}]")
                    kwargs = {"stage_name": stage, "cfg": cfg, "inputs": inputs, "force": force,
                              "part": (phase.name, r, n), "prior": prior}
                    pooled = runner and not phase.plans  # a plan (a listing) here: no process to start for it
                    states.append(runner.submit(one, kwargs) if pooled else one(**kwargs, return_state=True))
                return self._record_parts([(f"{name}[{r}/{n}]", s) for r, s in enumerate(states)])

            return run_phases(st, cfg, inputs, build_phase)

    def _record_parts(self, parts: list[tuple[str, object]]) -> list[Manifest]:
        """A phase's parts, recorded; a pool process that died under some (the kernel's OOM killer SIGKILLs
        one when memory runs out, and the pool then fails every part it had not finished) is said plainly. One
        that died while the pool still started its processes fails the part being submitted with an OSError (the
        broken pool closed the queue the new process was to be given) beside the others' BrokenProcessPool: that
        OSError counts as the same death."""
        done, lost = [], []
        for label, state in parts:  # a future on the runner, or a final state
            try:
                if isinstance(state, PrefectFuture):
                    state.wait()
                    state = state.state
            except (BrokenProcessPool, OSError) as e:
                lost.append((label, e))
                continue
            done.append(self._record(label, state))
        if lost and not any(isinstance(e, BrokenProcessPool) for _, e in lost):
            raise lost[0][1]  # the pool's own failure to start a process (too many open files, say)
        if lost:
            raise PoolProcessDied(
                f"{', '.join(label for label, _ in lost)}: a process of the shard pool was killed while these "
                "parts ran or waited, most likely by the kernel's OOM killer: memory ran out (`dmesg` or "
                "`journalctl -k` names the killed process). Each part holds about 1/shards of its stage's input: "
                "raise `execution.shards` (`filter.shards` for filter, `dedup.partitions` for dedup's reduce) for "
                "smaller parts, or lower `execution.workers` for fewer at once. Parts already built are reused "
                "when you run again.")
        return done

    def _record(self, label: str, state) -> Manifest:
        manifest: Manifest = state.result()
        made_by = manifest.lineage()["prefect"].get("task_run_id")
        self.stages[label] = {"artifact": manifest.path, "hash": manifest.hash,
                              "content_hash": manifest.content_hash,
                              "reused": made_by != str(state.state_details.task_run_id)}
        return manifest


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
