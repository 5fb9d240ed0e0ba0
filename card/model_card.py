"""The model card: a Hugging Face model card (YAML metadata, then Markdown) from the lineage graph."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from moeflow.card.graph import DATA_STAGES, by_stage
from moeflow.card.sections import RUN_RECORD, dedup_section, fates, filter_section, table
from moeflow.core import ledger
from moeflow.store.url import ensure

CARD = "README.md"


def _license(sources: dict) -> tuple[str, str | None]:
    licenses = sorted({s["license"] for s in sources.values()})
    hf = {"apache-2.0", "mit", "gpl-2.0", "cc-by-4.0"}
    if len(licenses) == 1 and licenses[0].lower() in hf:
        return licenses[0].lower(), None
    return "other", "mixed: " + ", ".join(licenses)


def render_card(graph: dict[str, dict]) -> str:
    """The model card (Markdown with YAML metadata) from the lineage graph of `collect`."""
    g = by_stage(graph)
    ing, train, ev = g["ingest"]["stats"], g["train"], g["evaluate"]
    ts, model_cfg = train["stats"], train["config"]["model"]
    sources = ing["sources"]
    bench, bench_cfg = g["benchmarks"]["stats"], g["benchmarks"]["config"]
    decon = g["decontaminate"]["stats"]
    overlap = g["overlap"]["stats"] if "overlap" in g else None
    license_id, license_name = _license(sources)
    name = f"moeflow-{train['run_config']}-moe"
    heldout = ev["stats"]["heldout"]
    data = ModelCardData(
        language=list(g["filter"]["config"].get("languages") or []) or None,  # only what was identified
        license=license_id,
        license_name=license_name,
        library_name="pytorch",
        tags=["moeflow", "mixture-of-experts", "dropless-moe", "text-generation"],
        datasets=sorted(sources),
        model_name=name,
        eval_results=[
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
            for d, r in sorted(heldout.items())
        ] + _score_results(ev, g["benchmarks"]),
    )
    code = train["code"]
    mix = g["mix"]["stats"]
    out = [
        f"# {name}",
        "",
        f"A {ts['params_total']:,}-parameter dropless Mixture-of-Experts language model "
        f"({ts['params_active']:,} active per token), trained by moeflow from the "
        f"`{train['run_config']}` config. "
        "Every figure below is read from the run's lineage records.",
        "",
        "## Model",
        "",
        table(
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
                [
                    "routing",
                    "dropless (no token dropped)"
                    if model_cfg.get("capacity_factor") is None
                    else f"capacity factor {model_cfg['capacity_factor']} (tokens over an expert's capacity "
                    f"are dropped; mean drop rate {ts['token_drop_rate']})",
                ],
                ["backend", model_cfg["backend"]],
                ["context length", ", ".join(f"{ph['seq_len']} ({ph['name']})" for ph in mix["phases"])],
                ["vocabulary", ts["vocab_size"]],
                ["tokenizer", g["tokenizer"]["stats"]["kind"]],
            ],
        ),
        "",
        "## Data",
        "",
        "The curated corpus has its own card, generated from the same lineage: "
        "[dataset_card.md](dataset_card.md) (`moeflow export` writes the corpus as a Hugging Face dataset "
        "with it).",
        "",
        "### Sources",
        "",
        table(
            ["source", "package", "version", "license", "domain", "files", "documents", "quarantined"],
            [
                [
                    n,
                    s["package"] or "(user files)",
                    s["version"] or "-",
                    s["license"],
                    s["domain"],
                    s["files"],
                    s["documents"],
                    s["quarantined"],
                ]
                for n, s in sorted(sources.items())
            ],
        ),
        "",
        "### Documents per stage",
        "",
        table(
            ["stage", "documents in", "documents out", "removed (fate:reason count)"],
            [
                [st, g[st]["stats"]["documents_in"], g[st]["stats"]["documents_out"], fates(g[st]["stats"])]
                for st in DATA_STAGES
            ],
        ),
        *filter_section(g["filter"]["stats"]),
        *dedup_section(g["dedup"]["stats"]),
        "",
        f"### Benchmark contamination ({bench['ngram']}-gram overlap)",
        "",
        f"N-grams are {bench['ngram']} consecutive lower-cased `\\w+` words (punctuation and spacing "
        f"ignored); n-grams found in more than {bench_cfg['max_items_per_ngram']} items, or with "
        f"fewer than {bench_cfg['min_alpha_words']} non-numeric words, are not indexed; items shorter "
        f"than {bench['ngram']} words cannot be indexed. A document sharing an indexed n-gram is "
        + ("dropped." if decon.get("action", "drop") == "drop" else "cut around each match (or dropped).")
        + (
            " Remaining overlap is measured by decoding the final token store and checking it again."
            if overlap
            else ""
        ),
        "",
        table(
            [
                "benchmark",
                "split",
                "items",
                "items too short",
                "n-grams indexed",
                "documents dropped",
                "documents cut",
                "characters removed",
                "overlap left in token store (documents)",
            ],
            [
                [
                    b,
                    s["split"],
                    s["items"],
                    s["items_too_short"],
                    s["ngrams"],
                    decon.get("per_benchmark", {}).get(b, {}).get("documents_dropped", 0),
                    decon.get("per_benchmark", {}).get(b, {}).get("documents_cut", 0),
                    decon.get("per_benchmark", {}).get(b, {}).get("chars_removed", 0),
                    overlap["remaining"].get(b, {}).get("documents", 0) if overlap else "not measured",
                ]
                for b, s in sorted(bench["benchmarks"].items())
            ],
        ),
        "",
        "### Training mix",
        "",
        f"Tokens per domain and curriculum phase, as packed into the mix (sequences of context length + 1; "
        f"{mix['batch_size']} sequences per step); epochs count how often a domain's documents have been "
        "drawn by the end of the phase.",
        "",
        table(
            [
                "phase",
                "steps",
                "context length",
                "domain",
                "weight",
                "tokens planned",
                "tokens in mix",
                "epochs so far",
            ],
            [
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
            ],
        ),
        "",
        table(
            [
                "domain",
                "training documents",
                "training tokens available",
                "tokens in mix",
                "epochs",
                "held-out documents",
            ],
            [
                [
                    d,
                    p["documents"],
                    p["training_tokens_available"],
                    p["tokens"],
                    p["epochs"],
                    mix["heldout_documents"].get(d, 0),
                ]
                for d, p in sorted(mix["plan"].items())
            ],
        ),
        "",
        "## Training",
        "",
        table(
            ["field", "value"],
            [
                ["steps", ts["steps"]],
                ["tokens", f"{ts['tokens']:,}"],
                [
                    "tokens planned (mix phases, inputs per sequence)",
                    f"{sum(ph['steps'] * mix['batch_size'] * ph['seq_len'] for ph in mix['phases']):,}",
                ],
                ["batch size", ts["batch_size"]],
                ["initial loss (mean of first 10 steps)", ts["initial_loss"]],
                ["final loss (mean of last 10 steps)", ts["final_loss"]],
                ["schedule", f"{ts.get('schedule', 'cosine')}, {ts.get('precision', 'fp32')}"],
                [
                    "resumes",
                    (", ".join(f"from step {r['from_step']}" for r in ts.get("resumes", [])) or "none")
                    + " (a resume continues the same config: checkpoints live in a folder keyed by the "
                    "train stage's config hash, so a changed config starts a new run and a new artifact)",
                ],
                ["train artifact", f"train-{train['artifact']['hash']}"],
                ["code commit", code["commit"] + (" (uncommitted changes)" if code.get("dirty") else "")],
                ["source hash", code["source_hash"]],
                [
                    "hardware",
                    _hardware(train),
                ],
            ],
        ),
        "",
        "## Training health",
        "",
        "![loss and learning rate](plots/loss.png)",
        "",
        "![grad norm](plots/grad_norm.png)",
        "",
        "![load imbalance and token drop](plots/balance.png)",
        "",
        "![expert load per layer](plots/expert_load.png)",
        "",
        table(
            ["field", "value"],
            [
                ["token drop rate (mean over steps)", ts["token_drop_rate"]],
                ["peak grad norm", ts.get("peak_grad_norm", "-")],
                [
                    "final load imbalance per MoE layer (max/mean)",
                    ", ".join(map(str, ts.get("final_load_imbalance", []))),
                ],
                ["alarms", _alarms(ts.get("alarms", []))],
            ],
        ),
        *(_ladder_section(g["ladder"], ts) if "ladder" in g else []),
        *(_ranks_section(ts["distributed"], train["config"]["model"]) if ts.get("distributed") else []),
        "",
        "## Evaluation",
        "",
        *_scores_section(ev, train, g["decontaminate"]),
        f"Held-out documents (chosen by a hash of their id, never trained on) of each domain, packed at the "
        f"last phase's context length. Checkpoint: the final one of `train-{train['artifact']['hash']}` "
        f"(step {ts['steps']}); "
        f"evaluation code: `evaluate` code `{ev['code']['source_hash']}`, "
        f"commit `{ev['code']['commit']}`. "
        f"Contamination: the held-out documents passed the same {bench['ngram']}-gram decontamination as the "
        f"training data, against {len(bench['benchmarks'])} benchmarks (above).",
        "",
        table(
            ["domain", "held-out loss", "perplexity", "sequences", "tokens", "documents", "decontaminated"],
            [
                [
                    d,
                    r["loss"],
                    r["perplexity"],
                    r["sequences"],
                    r["tokens"],
                    mix["heldout_documents"].get(d, 0),
                    "yes",
                ]
                for d, r in sorted(heldout.items())
            ],
        ),
        "",
        "## Limitations and intended use",
        "",
        *_limitations(g),
        "",
        RUN_RECORD,
        "",
        "Everything in this card that differs between two runs of the same config is in this section: "
        "timings, times, Prefect run ids, and the content hashes of artifacts that keep timings (`train` "
        "keeps its tokens/s and TensorBoard event files; the card and report contain this section). "
        "Everything above it is reproducible.",
        "",
        table(
            ["field", "value"],
            [
                ["tokens/s (median step)", ts["tokens_per_s"]],
                ["achieved TFLOP/s (median step)", ts.get("tflops", "-")],
                ["MFU", ts["mfu"] if ts.get("mfu") is not None else "not reported (train.peak_tflops unset)"],
                ["training seconds", ts.get("train_seconds", "-")],
                *(
                    [
                        [
                            "share of step time in the token all-to-all, per rank",
                            ", ".join(
                                f"rank {r['rank']}: {r['all_to_all_share']:.1%}"
                                for r in ts["distributed"]["ranks"]
                            ),
                        ]
                    ]
                    if (ts.get("distributed") or {}).get("expert_parallel")
                    else []
                ),
                *(
                    [
                        ["ladder prediction registered at", g["ladder"]["stats"]["registered_at"]],
                        ["target run started at", train["started_at"]],
                    ]
                    if "ladder" in g
                    else []
                ),
            ],
        ),
        "",
        table(
            ["stage", "artifact", "content hash", "Prefect task run", "finished at", "seconds"],
            [
                [
                    r["stage"],
                    name,
                    r["artifact"]["content_hash"],
                    r["prefect"].get("task_run_id", "-"),
                    r["finished_at"],
                    r["seconds"],
                ]
                for name, r in graph.items()
            ],
        ),
        "",
        "See `lineage_report.md` for every stage's config, inputs and statistics.",
        "",
    ]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(out)).content


def _splits(bench_rec: dict) -> dict[str, str]:
    return {b: v["split"] for b, v in bench_rec["stats"]["benchmarks"].items()}


def _score_results(ev: dict, bench_rec: dict) -> list[EvalResult]:
    """model-index entries: each task's `acc` (and `acc_norm`), on every sampled item."""
    split = _splits(bench_rec)
    return [
        EvalResult(task_type="multiple-choice" if r.get("chance") else "text-generation",
                   dataset_type=task, dataset_name=task, dataset_split=split.get(r["benchmark"], "test"),
                   metric_type=metric, metric_name=f"{metric} (zero-shot, {r['samples']} items)",
                   metric_value=r[metric])
        for task, r in sorted(ev["stats"].get("benchmarks", {}).items())
        for metric in ("acc", "acc_norm") if metric in r
    ]


def _with_clean_splits(ev: dict, decon: dict) -> dict:
    """Each task's scores, with its score on the clean items where the decontamination upstream of the
    model found sampled items in training documents (from its ledger and evaluate's per-item records)."""
    from moeflow.moe import scores as metrics

    matched = metrics.matched_items(ensure(Path(decon["_dir"]), ledger.LEDGER).parent)
    items = metrics.read_items(Path(ev["_dir"]))
    return {task: {**r, **(metrics.clean_split(items.get(task, []), matched) or {})}
            for task, r in ev["stats"]["benchmarks"].items()}


def _scores_section(ev: dict, train: dict, decon: dict) -> list[str]:
    """The benchmark scores table, flagged where decontamination found sampled items in training data."""
    if not ev["stats"].get("benchmarks"):
        return []
    scores = _with_clean_splits(ev, decon)
    ckpt = f"train-{train['artifact']['hash'][:12]} step {train['stats']['steps']}"
    code = f"`{ev['code']['source_hash'][:12]}`"
    rows, near, scored, flagged = [], 0, 0, []
    for task, r in sorted(scores.items()):
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
    return [
        "### Benchmark scores",
        "",
        "Zero-shot, scored by log-likelihood in lm-evaluation-harness's prompt formats and metrics (`acc`: "
        "the most likely choice; `acc_norm`: per character; LAMBADA: greedy last word and perplexity), on a "
        f"fixed subset of at most {ev['config']['benchmark_items']} items per task (seed "
        f"{ev['config']['benchmark_seed']}). Standard errors are the sample standard deviation over the "
        "square root of the item count. Chance is the mean of 1 / choices over the items scored.",
        "",
        table(["task", "benchmark", "metric", "value", "stderr", "chance", "samples", "checkpoint",
                "evaluate code", "contamination"], rows),
        "",
        f"{near} of {scored} scores are no more than two standard errors above chance"
        + (": expected for a model this small and this briefly trained." if near else "."),
        f"Flagged (decontamination found some of the sampled items in training documents, which it then "
        f"removed or cut): {', '.join(flagged)}; beside their score on all items, the score on the clean "
        "ones."
        if flagged else "No sampled item of any task was found in the training data by decontamination.",
        "",
    ]


def _hardware(train: dict) -> str:
    """The device training computed on (recorded by the run), then the host it ran on."""
    host = f"{train['host']['platform']}, {train['host']['cpus']} CPUs"
    dev = train["stats"].get("device")
    if dev is None:  # recorded before runs named their device
        return host + (f", {train['host']['cuda']}" if train["host"].get("cuda") else "")
    what = f"{dev['count']} x {dev['name']}" if dev["type"] == "cuda" else f"CPU ({dev['name'] or 'unknown'})"
    return f"trained on {what}; host {host}"


def _ranks_section(d: dict, model: dict) -> list[str]:
    """Per-rank health of a torchrun run.

    Which experts each rank held and how many assignments they processed.
    """
    if not d["expert_parallel"]:
        return [
            "",
            "### Ranks",
            "",
            f"{d['world_size']} ranks over {d['nnodes']} node(s), data parallel with every "
            "expert replicated on every rank (train.distributed.expert_parallel: false).",
        ]
    per = model["num_experts"] // d["world_size"]
    total = sum(sum(map(sum, r["expert_tokens"])) for r in d["ranks"]) or 1
    rows = [
        [
            r["rank"],
            f"{r['rank'] * per}-{(r['rank'] + 1) * per - 1}",
            "; ".join(
                f"layer {i}: " + ", ".join(f"e{r['rank'] * per + e} {n:,}" for e, n in enumerate(layer))
                for i, layer in enumerate(r["expert_tokens"])
            ),
            f"{sum(map(sum, r['expert_tokens'])) / total:.1%}",
        ]
        for r in d["ranks"]
    ]
    return [
        "",
        "### Ranks",
        "",
        f"{d['world_size']} ranks over {d['nnodes']} node(s) under torchrun: data parallel over all ranks, "
        f"the {model['num_experts']} experts split {per} per rank; every (token, expert) assignment travels "
        "to the rank holding its expert by a ragged all-to-all, none dropped. Assignments processed over "
        "the run (the share of step time spent in the all-to-all is a timing: see the run record).",
        "",
        table(["rank", "experts", "assignments processed per MoE layer and expert", "share"], rows),
    ]


def _limitations(g: dict[str, dict]) -> list[str]:
    """Limits read from the data (`g`: stage -> record): languages kept and removed, domains, size."""
    ts, fil, mix = g["train"]["stats"], g["filter"], g["mix"]["stats"]
    langs = fil["config"].get("languages")
    removed = []  # (count, what)
    for key, n in fil["stats"]["fates"].items():
        if key.startswith("dropped:language."):
            lang = key.removeprefix("dropped:language.")
            removed.append(
                (
                    n,
                    f"`{lang.removesuffix('_uncertain')}` below the threshold"
                    if lang.endswith("_uncertain")
                    else f"`{lang}`",
                )
            )
    if langs:
        lang_line = (
            f"- Languages: {', '.join(langs)} only. The language filter (fastText lid.176, probability >= "
            f"{fil['config']['language_threshold']}) removed "
            + (
                ", ".join(
                    f"{n} identified as {what}" for n, what in sorted(removed, key=lambda x: (-x[0], x[1]))
                )
                or "no documents"
            )
            + "; text in other languages is out of distribution."
        )
    else:
        lang_line = (
            "- Languages: not identified (no language filter in this run); "
            "the card cannot say which are present."
        )
    tokens = mix["train_tokens_per_domain"]
    total = sum(tokens.values()) or 1
    configured = {s["domain"] for s in g["ingest"]["stats"]["sources"].values()}
    missing = sorted(configured - {d for d, n in tokens.items() if n})
    return [
        lang_line,
        "- Domains: "
        + ", ".join(f"{d} ({n / total:.0%} of training tokens)" for d, n in sorted(tokens.items()))
        + ". "
        + (f"Configured but absent from training: {', '.join(missing)}. " if missing else "")
        + "Any other kind of text (web pages, dialogue, other programming languages, mathematics) was "
        "not in the training data.",
        f"- Size: {ts['params_total']:,} parameters trained on {ts['tokens']:,} tokens: a research-scale "
        "model for testing the pipeline, not for any use that relies on its outputs.",
        f"- Benchmarks: training text was checked against {len(g['benchmarks']['stats']['benchmarks'])} "
        "benchmarks' test items (above); benchmarks not listed there were not checked.",
    ]


def _alarms(alarms: list[dict], show: int = 5) -> str:
    if not alarms:
        return "none"
    kinds: dict[str, int] = {}
    for a in alarms:
        kinds[a["alarm"].split(":")[0]] = kinds.get(a["alarm"].split(":")[0], 0) + 1
    first = "; ".join(f"step {a['step']}: {a['alarm']}" for a in alarms[:show])
    return (
        ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items()))
        + f". First: {first}"
        + ("; ..." if len(alarms) > show else "")
    )


def _ladder_section(lad: dict, ts: dict) -> list[str]:
    p = lad["stats"]
    actual = ts["tail_loss"]
    err = (actual - p["predicted_final_loss"]) / actual
    inside = p["band"][0] <= actual <= p["band"][1]
    fit = p["fit"]
    return [
        "",
        "## Scaling ladder (pre-registered prediction)",
        "",
        f"{len(p['rungs'])} rungs of the same recipe used {p['ladder_fraction']:.1%} of the target run's "
        "training FLOPs. "
        f"Fit L(C) = E + A (C / C_target)^-alpha: E = {fit['E']:.4g}, A = {fit['A']:.4g}, "
        f"alpha = {fit['alpha']:.4g} "
        f"(residual RMS {fit['residual_rms']:.4g}; band from {fit['bootstrap_fits']} bootstrap refits). "
        f"Registered in `ladder-{lad['artifact']['hash']}` before the target run started "
        "(the time is in the run record).",
        "",
        table(
            ["rung", "d_model", "layers", "active parameters", "steps", "FLOPs", "final loss"],
            [
                [
                    i,
                    r["d_model"],
                    r["n_layers"],
                    f"{r['params_active']:,}",
                    r["steps"],
                    f"{r['flops']:.3g}",
                    r["final_loss"],
                ]
                for i, r in enumerate(p["rungs"])
            ],
        ),
        "",
        table(
            ["", "final loss (mean of the last tenth of steps)"],
            [
                ["predicted", f"{p['predicted_final_loss']} (band {p['band'][0]} to {p['band'][1]})"],
                ["actual", f"{actual} ({'inside' if inside else 'outside'} the band)"],
                [
                    "training steps whose smoothed loss left the ladder's band",
                    ts.get("steps_outside_ladder_band", "-"),
                ],
                ["relative error (actual - predicted) / actual", f"{err:+.2%}"],
            ],
        ),
    ]
