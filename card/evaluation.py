"""The model card's evaluation: benchmark scores (flagged where decontamination found items) and held-out loss."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import EvalResult

from moeflow.card.sections import table
from moeflow.core import ledger
from moeflow.moe import scores as metrics
from moeflow.store.url import ensure


def results(g: dict[str, dict]) -> list[EvalResult]:
    """model-index entries: held-out loss per domain, then each task's `acc` (and `acc_norm`) on every
    sampled item."""
    heldout = [
        EvalResult(
            task_type="text-generation",
            dataset_type="moeflow-heldout",
            dataset_name=f"held-out {d}",
            dataset_config=d,
            dataset_split="heldout",
            metric_type="loss",
            metric_name="held-out loss",
            metric_value=r["loss"],
        )
        for d, r in sorted(g["evaluate"]["stats"]["heldout"].items())
    ]
    split = {b: v["split"] for b, v in g["benchmarks"]["stats"]["benchmarks"].items()}
    return heldout + [
        EvalResult(task_type="multiple-choice" if r.get("chance") else "text-generation",
                   dataset_type=task, dataset_name=task, dataset_split=split.get(r["benchmark"], "test"),
                   metric_type=metric, metric_name=f"{metric} (zero-shot, {r['samples']} items)",
                   metric_value=r[metric])
        for task, r in sorted(g["evaluate"]["stats"].get("benchmarks", {}).items())
        for metric in ("acc", "acc_norm") if metric in r
    ]


def _with_clean_splits(ev: dict, decon: dict) -> dict:
    """Each task's scores, with its score on the clean items where the decontamination upstream of the
    model found sampled items in training documents (from its ledger and evaluate's per-item records)."""
    matched = metrics.matched_items(ensure(Path(decon["_dir"]), ledger.LEDGER).parent)
    items = metrics.read_items(ensure(Path(ev["_dir"]), metrics.ITEMS).parent)
    return {task: {**r, **(metrics.clean_split(items.get(task, []), matched) or {})}
            for task, r in ev["stats"]["benchmarks"].items()}


def scores(ev: dict, train: dict, decon: dict) -> dict | None:
    """The benchmark scores table, flagged where decontamination found sampled items in training data, and
    how many scores are within two standard errors of chance; None when no benchmark was scored."""
    if not ev["stats"].get("benchmarks"):
        return None
    ckpt = f"train-{train['artifact']['hash'][:12]} step {train['stats']['steps']}"
    code = f"`{ev['code']['source_hash'][:12]}`"
    rows, near, scored, flagged = [], 0, 0, []
    for task, r in sorted(_with_clean_splits(ev, decon).items()):
        for metric in [m for m in ("acc", "acc_norm") if m in r]:
            if r.get("chance") is not None:  # no more than two standard errors above chance
                scored += 1
                stderr = r[f"{metric}_stderr"]
                near += stderr is not None and r[metric] - r["chance"] <= 2 * stderr
            clean = r.get("clean", {})
            flag = (f"⚠ {r['contaminated_samples']} of {r['samples']} items found in training data; "
                    f"clean: {clean.get(metric, 'n/a')} ({clean.get('samples', 0)} items)"
                    if "clean" in r else "none found")
            rows.append([task, r["benchmark"], metric, r[metric], r.get(f"{metric}_stderr"),
                         r.get("chance") if r.get("chance") is not None else "n/a", r["samples"], ckpt,
                         code, flag])
        if "clean" in r:
            flagged.append(task)
        if "perplexity" in r:
            rows.append([task, r["benchmark"], "perplexity", r["perplexity"], "", "n/a", r["samples"], ckpt,
                         code, "none found" if "clean" not in r else "see acc"])
    head = ["task", "benchmark", "metric", "value", "stderr", "chance", "samples", "checkpoint", "evaluate code",
            "contamination"]
    return {"per_task": ev["config"]["benchmark_items"], "seed": ev["config"]["benchmark_seed"],
            "table": table(head, rows), "near_chance": near, "against_chance": scored, "flagged": flagged}


def heldout(g: dict[str, dict]) -> dict:
    """Held-out loss per domain (the documents each loss covers, and how much of their n-grams training
    documents hold), the held-out documents that leak above `mix.heldout.max_leak`, and the checkpoint and code
    that measured it."""
    train, ev, mix = g["train"], g["evaluate"], g["mix"]["stats"]
    leak = mix.get("heldout_leakage")  # absent from mixes made before it was measured
    shares = leak["per_domain"] if leak else {}
    rows = [
        [d, r["loss"], r["perplexity"], r["sequences"], r["tokens"],
         f"{r['documents']} of {r['heldout_documents']}" if "documents" in r
         else f"? of {mix['heldout_documents'].get(d, 0)}",
         _percent(shares[d]["share"]) if d in shares else "not measured", "yes"]
        for d, r in sorted(ev["stats"]["heldout"].items())
    ]
    head = ["domain", "held-out loss", "perplexity", "sequences", "tokens", "documents in the loss (of held out)",
            "n-grams also in training", "decontaminated"]
    out = {"checkpoint": f"train-{train['artifact']['hash']}", "steps": train["stats"]["steps"],
           "code": ev["code"]["source_hash"], "commit": ev["code"]["commit"], "table": table(head, rows),
           "cap": ev["config"].get("max_sequences_per_domain"), "leakage": None}
    if leak:
        shown = leak["leaks"] or leak["largest"]
        out["leakage"] = {
            "ngram": leak["ngram"], "max_leak": _percent(leak["max_leak"]), "group_by": leak["group_by"],
            "leaks": [r["doc_id"] for r in leak["leaks"]],
            "table": table(["held-out document", "domain", "n-grams also in training", "training document sharing most",
                            "n-grams shared with it"],
                           [[f"`{r['doc_id']}`", r["domain"], _percent(r["share"]),
                             f"`{r['top_training_doc']}`" if r["top_training_doc"] else "none", r["top_shared"]]
                            for r in shown]) if shown else None}
    return out


def _percent(share: float) -> str:
    return f"{100 * share:.1f}%"
