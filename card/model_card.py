"""The model card: a Hugging Face model card (YAML metadata, then Markdown) from the lineage graph."""

from __future__ import annotations

from huggingface_hub import ModelCard, ModelCardData

from moeflow.card import evaluation, training
from moeflow.card.graph import DOCUMENT_STAGES, by_stage
from moeflow.card.render import render
from moeflow.card.sections import SECONDS, dedup_clusters, edited_tier, filter_table, seconds, stages_table, table

CARD = "README.md"
TEMPLATE = "model_card.md.j2"


def render_card(graph: dict[str, dict], export: dict | None = None) -> str:
    """The model card (Markdown with YAML metadata) from the lineage graph of `collect`; `export`: the stats
    of the export this card is written into, where the graph has no export record yet."""
    g = by_stage(graph)
    exported = _export(g["export"]["stats"], g["export"]) if "export" in g else (
        _export(export, None) if export else None)
    train = g["train"]
    ts = train["stats"]
    text = render(
        TEMPLATE,
        card_data=_metadata(g, bool(exported)).to_yaml(),
        export=exported,
        name=_model_name(train),
        run_config=train["run_config"],
        ts=ts,
        dropless=_dropless(train),
        model_table=_model_table(g),
        sources_table=_sources_table(g["ingest"]["stats"]["sources"]),
        stages_table=stages_table([g[st] for st in DOCUMENT_STAGES if st in g]),
        filter_table=filter_table(g["filter"]["stats"]),
        dedup=dedup_clusters(g["dedup"]["stats"]),
        contamination=_contamination(g),
        mix=_mix(g["mix"]["stats"]),
        training_table=_training_table(g),
        health_table=training.health_table(ts),
        phase_health_table=training.phase_health_table(ts),
        mix_search=training.mix_search(g["mix_search"], g["evaluate"]) if "mix_search" in g else None,
        ladder=training.ladder(g["ladder"], ts, g.get("evaluate")) if "ladder" in g else None,
        ranks=training.ranks(ts["distributed"], train["config"]["model"]) if ts.get("distributed") else None,
        scores=evaluation.scores(g["evaluate"], train, g["decontaminate"]),
        heldout=evaluation.heldout(g),
        limits=_limitations(g),
        run_record=_run_record(graph, g),
    )
    return ModelCard(text).content


def _model_name(train: dict) -> str:
    return f"moeflow-{train['run_config']}-moe"


def _dropless(train: dict) -> bool:
    """Whether every (token, expert) assignment was computed: no capacity factor capped the experts."""
    return train["config"]["model"].get("capacity_factor") is None


def _license(sources: dict) -> tuple[str, str | None]:
    licenses = sorted({s["license"] for s in sources.values()})
    hf = {"apache-2.0", "mit", "gpl-2.0", "cc-by-4.0"}
    if len(licenses) == 1:
        return (licenses[0].lower(), None) if licenses[0].lower() in hf else ("other", licenses[0])
    return "other", "mixed: " + ", ".join(licenses)


def _export(stats: dict, record: dict | None) -> dict:
    """The export's architecture, where it is (`record`: its lineage; None: the folder this card is written
    into), and how closely transformers reproduced moeflow's model."""
    rows = [[d, r["sequences"], r["tokens"], r["moeflow_loss"], r["transformers_loss"], r["abs_loss_diff"],
             r["max_abs_logprob_diff"]] for d, r in sorted(stats["domains"].items())]
    return {
        "architecture": stats["architecture"],
        "transformers": stats["transformers"],
        # the artifact's name follows train's bytes (its timings), so it is named in the run record only
        "artifact": "the run's `export` artifact (named in the run record below)" if record else "this folder",
        "path": "<store>/export/export-<hash>" if record else ".",
        "max_diff": stats["max_abs_logprob_diff"],
        "tokens": stats["tokens_compared"],
        "tolerance": stats["tolerance"],
        "tokenizer": stats["tokenizer_class"],
        "texts": stats["texts_compared"],
        "table": table(["domain", "sequences", "tokens", "moeflow loss", "transformers loss", "abs. Δ loss",
                        "max. abs. Δ log p"], rows),
    }


def _metadata(g: dict[str, dict], exported: bool = False) -> ModelCardData:
    """The card's YAML: languages (only what was identified), licence, datasets, and the eval results; the
    library is transformers where the model was exported (else moeflow's own PyTorch files)."""
    sources = g["ingest"]["stats"]["sources"]
    license_id, license_name = _license(sources)
    return ModelCardData(
        language=list(g["filter"]["config"].get("languages") or []) or None,  # only what was identified
        license=license_id,
        license_name=license_name,
        library_name="transformers" if exported else "pytorch",
        pipeline_tag="text-generation" if exported else None,
        tags=["moeflow", "mixture-of-experts", *(["dropless-moe"] * _dropless(g["train"])), "text-generation"],
        datasets=sorted(sources),
        model_name=_model_name(g["train"]),
        eval_results=evaluation.results(g),
    )


def _model_table(g: dict[str, dict]) -> str:
    ts, model_cfg = g["train"]["stats"], g["train"]["config"]["model"]
    routing = (
        "dropless (no token dropped)"
        if _dropless(g["train"])
        else f"capacity factor {model_cfg['capacity_factor']} (tokens over an expert's capacity "
        f"are dropped; mean drop rate {ts['token_drop_rate']})"
    )
    return table(
        ["field", "value"],
        [
            ["parameters (total)", f"{ts['params_total']:,}"],
            ["parameters (active)", f"{ts['params_active']:,}"],
            ["layers", model_cfg["n_layers"]],
            ["d_model", model_cfg["d_model"]],
            ["heads", model_cfg["n_heads"]],
            ["experts", model_cfg["num_experts"]],
            ["top-k", model_cfg["top_k"]],
            ["expert hidden", model_cfg["expert_hidden"]],
            ["shared expert hidden", model_cfg["shared_expert_hidden"]],
            ["routing", routing],
            ["backend", model_cfg["backend"]],
            ["context length", ", ".join(f"{ph['seq_len']} ({ph['name']})" for ph in g["mix"]["stats"]["phases"])],
            ["vocabulary", ts["vocab_size"]],
            ["tokenizer", g["tokenizer"]["stats"]["kind"]],
        ],
    )


def _sources_table(sources: dict) -> str:
    rows = [
        [n, s["package"] or "(user files)", s["version"] or "-", s["license"], s["domain"], s["files"],
         s["documents"], s["quarantined"]]
        for n, s in sorted(sources.items())
    ]
    return table(["source", "package", "version", "license", "domain", "files", "documents", "quarantined"], rows)


def _contamination(g: dict[str, dict]) -> dict:
    """How the benchmarks were indexed, what decontamination did per benchmark and what overlap is left."""
    bench, bench_cfg = g["benchmarks"]["stats"], g["benchmarks"]["config"]
    decon = g["decontaminate"]["stats"]
    per = decon.get("per_benchmark", {})
    overlap = g["overlap"]["stats"] if "overlap" in g else None
    rows = [
        [
            b,
            s["split"],
            s["items"],
            s["items_too_short"],
            s["ngrams"],
            per.get(b, {}).get("documents_dropped", 0),
            per.get(b, {}).get("documents_cut", 0),
            per.get(b, {}).get("flagged_ngram", 0),
            per.get(b, {}).get("flagged_edited", 0),
            per.get(b, {}).get("chars_removed", 0),
            overlap["remaining"].get(b, {}).get("documents", 0) if overlap else "not measured",
        ]
        for b, s in sorted(bench["benchmarks"].items())
    ]
    head = ["benchmark", "split", "items", "items too short", "n-grams indexed", "documents dropped",
            "documents cut", "flagged: intact n-gram", "flagged: edited item", "characters removed",
            "overlap left in token store (documents)"]
    return {
        "ngram": bench["ngram"],
        "max_items_per_ngram": bench_cfg["max_items_per_ngram"],
        "min_alpha_words": bench_cfg["min_alpha_words"],
        "dropped": decon.get("action", "drop") == "drop",
        "edited": edited_tier(g["decontaminate"]["config"]),
        "overlap_measured": bool(overlap),
        "benchmarks": len(bench["benchmarks"]),
        "table": table(head, rows),
    }


def _mix(mix: dict) -> dict:
    """Tokens per phase and domain as packed, and per domain over the whole run."""
    phases = [
        [
            ph["name"],
            f"{ph['start_step'] + 1}-{ph['start_step'] + ph['steps']}",
            ph["seq_len"],
            d,
            w,
            ph["target_tokens"].get(d, 0),
            ph["tokens_per_domain"].get(d, 0),
            ph["epochs_after"].get(d, 0),
        ]
        for ph in mix["phases"]
        for d, w in sorted(ph["weights"].items())
    ]
    domains = [
        [d, p["documents"], p["training_tokens_available"], p["tokens"], p["epochs"],
         mix["heldout_documents"].get(d, 0)]
        for d, p in sorted(mix["plan"].items())
    ]
    return {
        "batch_size": mix["batch_size"],
        "phases_table": table(["phase", "steps", "context length", "domain", "weight", "tokens planned",
                               "tokens in mix", "epochs so far"], phases),
        "domains_table": table(["domain", "training documents", "training tokens available", "tokens in mix",
                                "epochs", "held-out documents"], domains),
    }


def _resume(r: dict) -> str:
    """A resume and what it trained again (the steps recorded after its checkpoint)."""
    if "recomputed_steps" not in r:  # recorded before restarts were costed
        return f"from step {r['from_step']}"
    return (f"from step {r['from_step']}: {r['recomputed_steps']} steps trained again, "
            f"{r['recomputed_tokens']:,} tokens, {r['recomputed_flops']:.3g} FLOPs, {r['recomputed_seconds']} s")


def _training_table(g: dict[str, dict]) -> str:
    train, mix = g["train"], g["mix"]["stats"]
    ts, code = train["stats"], train["code"]
    planned = sum(ph["steps"] * mix["batch_size"] * ph["seq_len"] for ph in mix["phases"])
    resumes = (
        ("; ".join(map(_resume, ts.get("resumes", []))) or "none")
        + " (a resume continues the same config: checkpoints live in a folder keyed by the "
        "train stage's config hash, so a changed config starts a new run and a new artifact; the steps it "
        "trains again take the same rows, so the token budget is unchanged and the cost is compute)"
    )
    return table(
        ["field", "value"],
        [
            ["steps", ts["steps"]],
            ["tokens", f"{ts['tokens']:,}"],
            ["tokens planned (mix phases, inputs per sequence)", f"{planned:,}"],
            ["batch size", ts["batch_size"]],
            ["initial loss (mean of first 10 steps)", ts["initial_loss"]],
            ["final loss (mean of last 10 steps)", ts["final_loss"]],
            ["schedule", f"{ts.get('schedule', 'cosine')}, {ts.get('precision', 'fp32')}"],
            ["resumes", resumes],
            ["train artifact", f"train-{train['artifact']['hash']}"],
            ["code commit", code["commit"] + (" (uncommitted changes)" if code.get("dirty") else "")],
            ["source hash", code["source_hash"]],
            ["hardware", training.hardware(train)],
        ],
    )


def _limitations(g: dict[str, dict]) -> dict:
    """Limits read from the data (`g`: stage -> record): languages kept and removed, domains."""
    fil, mix = g["filter"], g["mix"]["stats"]
    removed = []  # (count, what)
    for key, n in fil["stats"]["fates"].items():
        if key.startswith("dropped:language."):
            lang = key.removeprefix("dropped:language.")
            base = lang.removesuffix("_uncertain")  # identified, but below the probability threshold
            removed.append((n, f"`{base}` below the threshold" if base != lang else f"`{lang}`"))
    tokens = mix["train_tokens_per_domain"]
    total = sum(tokens.values()) or 1
    configured = {s["domain"] for s in g["ingest"]["stats"]["sources"].values()}
    return {
        "languages": fil["config"].get("languages"),
        "language_threshold": fil["config"].get("language_threshold"),
        "languages_removed": ", ".join(
            f"{n} identified as {what}" for n, what in sorted(removed, key=lambda x: (-x[0], x[1]))),
        "domain_shares": ", ".join(f"{d} ({n / total:.0%} of training tokens)" for d, n in sorted(tokens.items())),
        "absent": sorted(configured - {d for d, n in tokens.items() if n}),
    }


def _run_record(graph: dict[str, dict], g: dict[str, dict]) -> dict:
    """What differs between two runs of one config: speeds, timings, times and Prefect task runs."""
    train = g["train"]
    ts = train["stats"]
    fields = [
        ["tokens/s (median step)", ts["tokens_per_s"]],
        ["achieved TFLOP/s per device (median step)", ts.get("tflops", "-")],
        ["MFU per device (median step)",
         ts["mfu"] if ts.get("mfu") is not None else "not reported (train.peak_tflops unset)"],
        ["training seconds", ts.get("train_seconds", "-")],
    ]
    if (ts.get("distributed") or {}).get("expert_parallel"):
        shares = ", ".join(f"rank {r['rank']}: {r['all_to_all_share']:.1%}" for r in ts["distributed"]["ranks"])
        fields.append(["share of step time in the token all-to-all, per rank", shares])
    if "ladder" in g:
        fields += [["ladder prediction registered at", g["ladder"]["stats"]["registered_at"]],
                   ["target run started at", train["started_at"]]]
    stages = [
        [r["stage"], name, r["artifact"]["content_hash"], r["prefect"].get("task_run_id", "-"), r["finished_at"],
         seconds(r)]
        for name, r in graph.items()
    ]
    return {
        "fields_table": table(["field", "value"], fields),
        "stages_table": table(["stage", "artifact", "content hash", "Prefect task run", "finished at", SECONDS],
                              stages),
    }
