"""The pretrain flow: registry packages to a trained dropless MoE and its model card.

One cached task per stage. `dag` reads like the picture of the DAG: each stage is a value declared in its own
package's `stages.py` (its config slice, body or phases, libraries, fetched files), one import away; `tasks/`
runs every one of them the same way.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.context import FlowRunContext

from moeflow import configs, export, ingest, quality
from moeflow.card.stages import CARD
from moeflow.core.logs import route_loguru, route_moeflow_logs
from moeflow.dedup.stages import BENCHMARKS, DECONTAMINATE, DEDUP, OVERLAP
from moeflow.export.stages import EXPORT
from moeflow.filters.stages import FILTER
from moeflow.ingest.stages import INGEST, SOURCES
from moeflow.moe.stages import EVALUATE, LADDER, MIX_SEARCH, PROXY, RUNG, TRAIN
from moeflow.quality.stages import QUALITY, QUALITY_MODEL
from moeflow.store.url import store_for
from moeflow.tasks.pipeline import Pipeline
from moeflow.tokenize.stages import MIX, PROXY_MIX, RUNG_MIX, TOKENIZE, TOKENIZER


@flow(name="pretrain")
def pretrain(config: str = "tiny", until: str | None = None, rerun: list[str] | None = None) -> dict:
    """Run the DAG for `config` (a preset name or a YAML path).

    `rerun` refreshes stages, `until` stops early.
    """
    route_loguru()  # datatrove's loguru messages into this run's Prefect log
    route_moeflow_logs()  # and moeflow's warnings: training alarms show in the UI as they fire
    cfg = configs.load(config)
    ingest.preflight(cfg)  # a source that matches nothing fails here, before any work
    quality.preflight(cfg)  # and a model file fastText cannot use, or too few positives
    export.preflight(cfg)  # and a model the export cannot write exactly (naming the option)
    run = Pipeline(cfg, rerun=rerun or (), until=until)
    # `moeflow gc` waits while this run uses the store, and until its record names what it used
    store = store_for(cfg.store_url())
    with store.in_use():
        card = dag(run, cfg)
        summary = {
            "config": cfg.name,
            "flow_run_id": _flow_run_id(),
            "store": cfg.store_url(),
            "stages": run.stages,
            "card": str(card.dir / "README.md") if card else None,
        }
        store.record_run(summary)
    get_run_logger().info("moeflow %s: %s", cfg.name, summary["card"] or f"stopped after {until}")
    return summary


def dag(run, cfg: configs.RunConfig):
    """The stages in order, each given its inputs.

    `run` builds or reuses them (or, for `moeflow why`, plans).
    """
    src = run(SOURCES)
    docs = run(INGEST)  # reads the fetched packages and local files: its key names their versions
    docs = run(FILTER, docs=docs)
    docs = run(DEDUP, docs=docs)
    scored = None
    if cfg.quality:  # a learned classifier keeps the best (none: the corpus goes on as deduplicated)
        docs = scored = run(QUALITY, docs=docs, model=run(QUALITY_MODEL, docs=docs))
    index = run(BENCHMARKS)
    docs = run(DECONTAMINATE, docs=docs, index=index)
    tok = run(TOKENIZER, docs=docs)
    shards = run(TOKENIZE, docs=docs, tokenizer=tok)
    leftover = run(OVERLAP, shards=shards, tokenizer=tok, index=index)
    buckets = {"quality": scored} if cfg.mix.quality_buckets else {}  # the mix draws by their scores
    if cfg.mix.search:  # proxy runs choose the weights, registered before the target's mix is built
        search = run.subflow(mix_search, cfg, shards, tok)
        cfg = run.searched(cfg, search)
        mixed = run(MIX, cfg=cfg, shards=shards, tokenizer=tok, search=search, **buckets)
    else:
        mixed = run(MIX, shards=shards, tokenizer=tok, **buckets)
    # registered before train
    prediction = run.subflow(ladder, cfg, mixed, shards, tok) if cfg.ladder and mixed else None
    model = run(TRAIN, mix=mixed, tokenizer=tok, **({"prediction": prediction} if prediction else {}))
    evals = run(EVALUATE, model=model, mix=mixed, tokenizer=tok, index=index)  # index: benchmark scores
    # the card reads the whole graph: its key follows train too (whose bytes change whenever it reruns),
    # not only evaluate, whose bytes stay the same when, say, only the ladder changed
    graph = {"evaluate": evals, "overlap": leftover, "model": model, "sources": src}
    if cfg.export:  # a stock transformers folder, compared on evaluate's rows, the card written into it too
        graph["export"] = run(EXPORT, mix=mixed, tokenizer=tok, **graph)
    return run(CARD, **graph)


@flow(name="mix_search", validate_parameters=False)
def mix_search(run, cfg, shards, tok):
    """The mixture search (a subflow): each proxy a cached training task on its own mix, then the fit and the
    chosen weights (`moe/mix_search.py`)."""
    from moeflow.moe import mix_search as search  # here: torch stays out of the data stages' workers

    proxies, mixes = {}, []
    for i, proxy in enumerate(search.plan(cfg, run.vocab(tok))):
        mixes.append(run(PROXY_MIX, cfg=proxy["cfg"], label=f"proxy_mix{i}", shards=shards, tokenizer=tok))
        proxies[f"proxy{i}"] = run(PROXY, cfg=proxy["cfg"], label=f"proxy{i}", mix=mixes[-1], tokenizer=tok)
    return run(MIX_SEARCH, shards=shards, tokenizer=tok, proxy_mix0=mixes[0], **proxies)


@flow(name="ladder", validate_parameters=False)
def ladder(run, cfg, mixed, shards, tok):
    """The scaling ladder (a subflow): each rung a cached training task, on its own mix of the whole
    curriculum (`rung_mix`) or on a prefix of the target's mix; then the fit."""
    from moeflow.moe import ladder as moe_ladder  # here: torch stays out of the data stages' workers

    rungs = {}
    for i, rung in enumerate(moe_ladder.plan(cfg, run.vocab(tok))):
        rung_cfg = cfg.model_copy(update={"model": rung["model"], "train": rung["train"]})
        rung_mix = (
            run(RUNG_MIX, cfg=rung_cfg, label=f"rung_mix{i}", shards=shards, tokenizer=tok)
            if rung["own_mix"]
            else mixed
        )
        rungs[f"rung{i}"] = run(RUNG, cfg=rung_cfg, label=f"rung{i}", mix=rung_mix, tokenizer=tok)
    held = {"mix": mixed} if cfg.ladder.fit == "additive" else {}  # its held-out rows score the rungs
    return run(LADDER, tokenizer=tok, **rungs, **held)


def _flow_run_id() -> str:
    ctx = FlowRunContext.get()
    return str(ctx.flow_run.id) if ctx and ctx.flow_run else "local"


if __name__ == "__main__":
    pretrain()
