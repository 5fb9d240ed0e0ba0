"""The pretrain flow: registry packages to a trained dropless MoE and its model card.

One cached task per stage.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.context import FlowRunContext

from moeflow import configs, ingest
from moeflow.core.logs import route_loguru, route_moeflow_logs
from moeflow.store.url import store_for
from moeflow.tasks.pipeline import Pipeline


@flow(name="pretrain")
def pretrain(config: str = "tiny", until: str | None = None, rerun: list[str] | None = None) -> dict:
    """Run the DAG for `config` (a preset name or a YAML path).

    `rerun` refreshes stages, `until` stops early.
    """
    route_loguru()  # datatrove's loguru messages into this run's Prefect log
    route_moeflow_logs()  # and moeflow's warnings: training alarms show in the UI as they fire
    cfg = configs.load(config)
    ingest.preflight(cfg)  # a source that matches nothing fails here, before any work
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
    src = run("sources")
    docs = run("ingest")  # reads the fetched packages and local files: its key names their versions
    docs = run("filter", docs=docs)
    docs = run("dedup", docs=docs)
    index = run("benchmarks")
    docs = run("decontaminate", docs=docs, index=index)
    tok = run("tokenizer", docs=docs)
    shards = run("tokenize", docs=docs, tokenizer=tok)
    leftover = run("overlap", shards=shards, tokenizer=tok, index=index)
    mixed = run("mix", shards=shards, tokenizer=tok)
    # registered before train
    prediction = run.subflow(ladder, cfg, mixed, shards, tok) if cfg.ladder and mixed else None
    model = run("train", mix=mixed, tokenizer=tok, **({"prediction": prediction} if prediction else {}))
    evals = run("evaluate", model=model, mix=mixed, tokenizer=tok, index=index)  # index: benchmark scores
    # the card reads the whole graph: its key follows train too (whose bytes change whenever it reruns),
    # not only evaluate, whose bytes stay the same when, say, only the ladder changed
    return run("card", evaluate=evals, overlap=leftover, model=model, sources=src)


@flow(name="ladder", validate_parameters=False)
def ladder(run, cfg, mixed, shards, tok):
    """The scaling ladder (a subflow): each rung a cached training task, on its own mix of the whole
    curriculum (`rung_mix`) or on a prefix of the target's mix; then the fit."""
    from moeflow.moe import ladder as moe_ladder  # here: torch stays out of the data stages' workers

    rungs = {}
    for i, rung in enumerate(moe_ladder.plan(cfg, run.vocab(tok))):
        rung_cfg = cfg.model_copy(update={"model": rung["model"], "train": rung["train"]})
        rung_mix = (
            run("rung_mix", cfg=rung_cfg, label=f"rung_mix{i}", shards=shards, tokenizer=tok)
            if rung["own_mix"]
            else mixed
        )
        rungs[f"rung{i}"] = run("rung", cfg=rung_cfg, label=f"rung{i}", mix=rung_mix, tokenizer=tok)
    return run("ladder", tokenizer=tok, **rungs)


def _flow_run_id() -> str:
    ctx = FlowRunContext.get()
    return str(ctx.flow_run.id) if ctx and ctx.flow_run else "local"


if __name__ == "__main__":
    pretrain()
