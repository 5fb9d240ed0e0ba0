"""The model card and lineage report, generated from the `lineage.json` records walked back from an artifact.

`generate(start, out)` writes `README.md` (a Hugging Face model card with YAML metadata), the corpus's
`dataset_card.md` (`card/dataset.py`),
`lineage_report.md`, a self-contained `lineage_report.html`, the artifact graph `lineage.svg` and the
health plots under `plots/`. Nothing is read but those lineage records (the config diff and the drill-down
are in them, written when the stages ran) and, for the plots, the metrics of the train artifact they name:
other artifacts in the store never change a byte, and `moeflow card ARTIFACT_DIR` rebuilds the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from moeflow.card import plots
from moeflow.core import ledger
from moeflow.store.url import ensure

CARD, REPORT, HTML, DAG = "README.md", "lineage_report.md", "lineage_report.html", "lineage.svg"
DATA_STAGES = ("ingest", "filter", "dedup", "decontaminate")
CARD_STAGES = (*DATA_STAGES, "benchmarks", "tokenizer", "mix", "train", "evaluate")  # each must be unique
OPTIONAL_STAGES = ("overlap", "ladder")
RUN_RECORD = "## Run record (differs between runs)"


def _name(artifact: dict) -> str:
    """An artifact's folder name, `<stage>-<hash>`, from a record's `artifact` or one of its `inputs`."""
    return f"{artifact['stage']}-{artifact['hash']}"


def _read(folder: Path) -> dict:
    path = ensure(folder, "lineage.json")  # an object store's record is fetched into this node's mirror
    if not path.exists():
        raise FileNotFoundError(f"{folder} has no lineage.json: not a moeflow artifact")
    return {**json.loads(path.read_text()), "_dir": str(folder)}  # _dir: where to read its files


def collect(roots: list[Path]) -> dict[str, dict]:
    """Artifact name (`<stage>-<hash>`) -> lineage record, for the `roots` and every artifact upstream of
    them, upstream first: a stage with several artifacts (the ladder's rungs) has one entry per artifact."""
    store = roots[0].parent.parent
    tops = [_read(r) for r in roots]
    found: dict[str, dict] = {}
    todo = list(tops)
    while todo:
        rec = todo.pop()
        if _name(rec["artifact"]) not in found:
            found[_name(rec["artifact"])] = rec
            todo += [_read(store / inp["path"]) for inp in rec["inputs"].values()]
    # A reused downstream artifact records the upstream one that built it, which may since have been
    # rebuilt with equal content: one entry per stage and content (the newest), and only what the roots
    # reach through those.
    newest: dict[tuple[str, str], dict] = {}
    for rec in sorted(found.values(), key=lambda r: (r["finished_at"], r["artifact"]["hash"])):
        newest[rec["stage"], rec["artifact"]["content_hash"]] = rec
    kept = {_name(r["artifact"]): r for r in newest.values()}
    graph: dict[str, dict] = {}
    todo = [newest[r["stage"], r["artifact"]["content_hash"]] for r in tops]
    while todo:
        rec = todo.pop()
        if _name(rec["artifact"]) not in graph:
            graph[_name(rec["artifact"])] = rec
            todo += [kept[n] for n in _upstream(kept, rec)]
    return _topological(graph)


def _upstream(graph: dict[str, dict], rec: dict) -> list[str]:
    """The artifacts of `graph` that `rec` read: each input, or the newer one of equal content kept."""
    names: set[str] = set()
    for inp in rec["inputs"].values():
        same = {n for n, r in graph.items()
                if r["stage"] == inp["stage"] and r["artifact"]["content_hash"] == inp["content_hash"]}
        names |= {_name(inp)} if _name(inp) in graph else same
    return sorted(names)


def _topological(graph: dict[str, dict]) -> dict[str, dict]:
    """Artifacts ordered upstream first (ties by start time, then name), as the DAG reads."""
    ups = {n: _upstream(graph, r) for n, r in graph.items()}
    done: dict[str, dict] = {}
    while len(done) < len(graph):
        ready = [n for n in graph if n not in done and all(u in done for u in ups[n])]
        n = min(ready, key=lambda n: (graph[n]["started_at"], n))
        done[n] = graph[n]
    return done


def single(graph: dict[str, dict], stage: str, required: bool = True) -> dict | None:
    """THE record of a stage that runs once per model (ingest, mix, train, evaluate, ...); None when
    absent and not `required`. Fails clearly when the lineage holds several artifacts of it."""
    recs = [r for r in graph.values() if r["stage"] == stage]
    if len(recs) > 1:
        raise ValueError(f"the lineage holds {len(recs)} `{stage}` artifacts, the card needs one: "
                         + ", ".join(_name(r["artifact"]) for r in recs))
    if not recs and required:
        raise KeyError(f"no `{stage}` artifact upstream of the card")
    return recs[0] if recs else None


def by_stage(graph: dict[str, dict]) -> dict[str, dict]:
    """Stage -> THE record, for the stages the card reads: each unique; overlap and ladder when they ran."""
    return ({st: single(graph, st) for st in CARD_STAGES}
            | {st: r for st in OPTIONAL_STAGES if (r := single(graph, st, required=False)) is not None})


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _fates(stats: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in stats.get("fates", {}).items() if k != "kept") or "none"


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
        _table(
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
        _table(
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
        _table(
            ["stage", "documents in", "documents out", "removed (fate:reason count)"],
            [
                [st, g[st]["stats"]["documents_in"], g[st]["stats"]["documents_out"], _fates(g[st]["stats"])]
                for st in DATA_STAGES
            ],
        ),
        *_filter_section(g["filter"]["stats"]),
        *_dedup_section(g["dedup"]["stats"]),
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
        _table(
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
        _table(
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
        _table(
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
        _table(
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
        _table(
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
        _table(
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
        _table(
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
        _table(
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
        _table(["task", "benchmark", "metric", "value", "stderr", "chance", "samples", "checkpoint",
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
        _table(["rank", "experts", "assignments processed per MoE layer and expert", "share"], rows),
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


def _filter_section(stats: dict) -> list[str]:
    if "by_source" not in stats:
        return []
    rows = [
        [
            src,
            c.get("kept", 0),
            c.get("kept:rewritten", 0),
            ", ".join(
                f"{k.removeprefix('dropped:')} {n}"
                for k, n in sorted(c.items(), key=lambda x: (-x[1], x[0]))
                if k.startswith("dropped:")
            )
            or "none",
        ]
        for src, c in sorted(stats["by_source"].items())
    ]
    return [
        "",
        "### Filter decisions per source",
        "",
        "Documents kept, kept after a rewrite (C4 removes lines), and dropped per filter step and reason "
        "(`step.reason`, datatrove's reason strings for its blocks), most frequent first.",
        "",
        _table(["source", "kept", "of which rewritten", "dropped (step.reason count)"], rows),
    ]


def _dedup_section(stats: dict) -> list[str]:
    exact, near = stats.get("cluster_sizes", {}), stats.get("minhash_cluster_sizes", {})
    sizes = sorted({*exact, *near}, key=int)
    return [
        "",
        "### Duplicate clusters",
        "",
        f"{stats.get('duplicate_clusters', 0)} exact clusters and {stats.get('minhash_clusters', 0)} "
        "MinHash clusters; each keeps its smallest document id. Clusters by size (documents in the "
        "cluster):",
        "",
        _table(
            ["cluster size", "exact clusters", "MinHash clusters"],
            [[z, exact.get(z, 0), near.get(z, 0)] for z in sizes],
        )
        if sizes
        else "No duplicates found.",
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
        _table(
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
        _table(
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


def _flat(obj, prefix: str = "") -> dict[str, object]:
    if isinstance(obj, (dict, list)):
        out: dict[str, object] = {}
        for k, v in obj.items() if isinstance(obj, dict) else enumerate(obj):
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def _short(value: object, width: int = 60) -> str:
    text = json.dumps(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def config_diff(rec: dict) -> tuple[str | None, list[str]]:
    """(previous artifact, changed config fields) against `rec["previous"]`: the latest other artifact
    of the same stage that had finished when this one started, recorded then (later runs change nothing)."""
    prev = rec.get("previous")
    if not prev:
        return None, []
    a, b = _flat(prev["config"]), _flat(rec["config"])
    changes = [
        f"`{k}`: {_short(a.get(k))} → {_short(b.get(k))}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]
    if len(changes) > 8:
        changes = changes[:8] + [f"and {len(changes) - 8} more"]
    return prev["artifact"], changes


def drill_down(graph: dict[str, dict], per_shard: int = 3) -> list[str]:
    """Token shards -> their first documents -> the raw files they came from, as the tokenize record says."""
    tok = single(graph, "tokenize", required=False)
    if tok is None:
        return []
    out = ["## Drill-down: token shards → documents → raw files", ""]
    if "by_shard" not in tok["stats"]:
        return out + [f"`{_name(tok['artifact'])}` recorded no per-shard detail.", ""]
    for s in tok["stats"]["by_shard"]:
        sources = ", ".join(f"{k} {v}" for k, v in sorted(s["sources"].items()))
        out += [
            f"- `{_name(tok['artifact'])}/shard-{s['shard']:05d}.arrow`: {s['documents']} documents, "
            f"{s['tokens']:,} tokens ({sources})"
        ]
        out += [
            f"  - row {r['row']}: `{r['doc_id']}` ({r['tokens']} tokens) from `{r['path']}`"
            for r in s["first_rows"][:per_shard]
        ]
    return out + ["", "`moeflow explain DOC_ID` follows any document through every stage.", ""]


def last_run(graph: dict[str, dict]) -> tuple[str | None, set[str]]:
    """The flow run that built the newest artifact of `graph` (the run that made this card, unless only the
    card itself changed), and the artifacts it built; the others it reused from earlier runs."""
    newest = max(graph.values(), key=lambda r: (r["finished_at"], r["started_at"]))
    run = newest["prefect"].get("flow_run_id")
    return run, {n for n, r in graph.items() if run and r["prefect"].get("flow_run_id") == run}


SVG_STYLE = {True: 'fill="#e3f4e6" stroke="#2e7d32"',  # rebuilt by the last run
             False: 'fill="#f2f2f2" stroke="#8a8a8a" stroke-dasharray="4 3"'}  # reused


def dag_svg(graph: dict[str, dict]) -> str:
    """The artifact graph as a standalone SVG: a box per artifact (stage, hash, and whether the last run
    built or reused it), a column per depth (longest path from a source), an arrow per artifact read."""
    from html import escape

    run, built = last_run(graph)

    ups = {n: _upstream(graph, r) for n, r in graph.items()}
    depth: dict[str, int] = {}
    for n in graph:  # `graph` is in topological order
        depth[n] = 1 + max((depth[u] for u in ups[n]), default=-1)
    columns: dict[int, list[str]] = {}
    for n in graph:
        columns.setdefault(depth[n], []).append(n)
    w, h, dx, dy, pad = 130, 46, 170, 62, 10
    pos = {n: (pad + d * dx, pad + i * dy) for d, names in columns.items() for i, n in enumerate(names)}
    width = pad * 2 + max(columns) * dx + w
    height = pad * 2 + max(len(v) for v in columns.values()) * dy - (dy - h) + 30
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="11"><defs><marker id="a" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" '
        'markerHeight="6" orient="auto"><path d="M0,0L10,5L0,10z" fill="#555"/></marker></defs>'
    ]
    for n in graph:
        for u in ups[n]:
            (x0, y0), (x1, y1) = pos[u], pos[n]
            x0, y0, y1 = x0 + w, y0 + h / 2, y1 + h / 2
            parts.append(
                f'<path d="M{x0},{y0} C{x0 + 30},{y0} {x1 - 30},{y1} {x1},{y1}" fill="none" stroke="#555" '
                'marker-end="url(#a)"/>'
            )
    for n, (x, y) in pos.items():
        parts.append(
            f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="4" {SVG_STYLE[n in built or not run]}/>'
            f'<text x="{x + w / 2}" y="{y + 14}" text-anchor="middle" font-weight="bold">'
            f"{escape(graph[n]['stage'])}</text>"
            f'<text x="{x + w / 2}" y="{y + 27}" text-anchor="middle" fill="#555">'
            f"{escape(graph[n]['artifact']['hash'][:12])}</text>"
            f'<text x="{x + w / 2}" y="{y + 40}" text-anchor="middle" fill="#555" font-style="italic">'
            f"{('rebuilt' if n in built else 'reused') if run else ''}</text>"
        )
    legend = f"last run: flow run {run}" if run else "no Prefect flow run recorded"
    parts.append(
        f'<g transform="translate({pad},{height - 18})"><rect width="12" height="12" {SVG_STYLE[True]}/>'
        f'<text x="16" y="10">rebuilt by the last run</text><rect x="170" width="12" height="12" '
        f'{SVG_STYLE[False]}/><text x="186" y="10">reused from an earlier run</text>'
        f'<text x="370" y="10" fill="#555">({escape(legend)})</text></g>'
    )
    return "\n".join(parts + ["</svg>", ""])


def render_report(graph: dict[str, dict]) -> str:
    """Every artifact's config, inputs, code, run and stats, upstream first, then the drill-down."""
    run, built = last_run(graph)
    out = [
        "# Lineage report",
        "",
        f"![artifact graph: a box per stage, its artifact hash, and whether the last run rebuilt it]({DAG})",
        "",
        f"Last run (flow run `{run}`): {len(built)} artifact(s) rebuilt, {len(graph) - len(built)} reused "
        "from earlier runs." if run else "No Prefect flow run is recorded for these artifacts.",
        "",
        "Artifacts, upstream first: " + " → ".join(graph),
        "",
    ]
    for name, r in graph.items():
        st = r["stage"]
        by = r["prefect"].get("flow_run_id")
        fate = "rebuilt" if name in built else f"reused (built by flow run `{by}`)"
        prev, changes = config_diff(r)
        if st == "filter":
            out += _waterfall_section(r)
        diff = (
            f"- config against the previous `{st}` artifact `{prev}`: "
            + ("; ".join(changes) or "unchanged (its inputs or the stage's code changed)")
            if prev
            else f"- no earlier `{st}` artifact had finished when this one started"
        )
        out += [
            f"## {st}: `{name}`",
            "",
            f"- last run: {fate}",
            f"- content hash: `{r['artifact']['content_hash']}`; code `{r['code']['source_hash']}`",
            "- inputs: " + (", ".join(f"{k} = `{v['path']}`" for k, v in r["inputs"].items()) or "none"),
            f"- code: commit `{r['code']['commit']}`"
            + (" (uncommitted changes)" if r["code"].get("dirty") else ""),
            "- Prefect: "
            + (", ".join(f"{k} `{v}`" for k, v in sorted(r["prefect"].items())) or "not run by Prefect"),
            f"- ran {r['started_at']} to {r['finished_at']} ({r['seconds']} s) on {r['host']['hostname']}",
            diff,
            "",
            "config:",
            "",
            "```json",
            json.dumps(r["config"], indent=2, sort_keys=True),
            "```",
            "",
            "stats:",
            "",
            "```json",
            json.dumps(r["stats"], indent=2, sort_keys=True),
            "```",
            "",
        ]
    return "\n".join(out + drill_down(graph))


def _waterfall_section(rec: dict) -> list[str]:
    """The filter's documents per source and step, as a chart (`plots/filter_waterfall.png`) and a table."""
    rows = plots.waterfall(rec["stats"], list(rec["config"].get("steps", [])))
    if not rows:
        return []
    steps = [s for s, _, _ in next(iter(rows.values()))]
    cells = [[src, *(f"{left} (-{rm})" if rm else str(left) for _, rm, left in series)]
             for src, series in rows.items()]
    table = _table(["source", *steps], cells)
    return ["## Filter waterfall", "", f"![filter waterfall](plots/{plots.WATERFALL})", "",
            "Documents left per source after each filter step, in the order the steps ran (-n: removed by "
            "that step; a document is counted at the first step that rejects it). Tokens are not counted "
            "here: filtering runs before tokenization.", "", table, ""]


def render_html(card_md: str, report_md: str, plots_dir: Path) -> str:
    """One self-contained HTML page (card, then report); plots inlined as data URIs, nothing fetched."""
    import base64

    import markdown

    body = card_md.split("---", 2)[2] if card_md.startswith("---") else card_md
    for name in plots.PLOTS:
        data = base64.b64encode((plots_dir / name).read_bytes()).decode()
        body = body.replace(f"(plots/{name})", f"(data:image/png;base64,{data})")
    if (plots_dir / plots.WATERFALL).exists():
        data = base64.b64encode((plots_dir / plots.WATERFALL).read_bytes()).decode()
        report_md = report_md.replace(f"(plots/{plots.WATERFALL})", f"(data:image/png;base64,{data})")
    dag = plots_dir.parent / DAG
    if dag.exists():
        report_md = report_md.replace(
            f"({DAG})", f"(data:image/svg+xml;base64,{base64.b64encode(dag.read_bytes()).decode()})"
        )
    html = markdown.markdown(body + "\n\n" + report_md, extensions=["tables", "fenced_code"])
    style = (
        "body{font-family:sans-serif;max-width:60em;margin:2em auto;padding:0 1em}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;font-size:90%}"
        "pre{background:#f6f6f6;padding:.5em;overflow-x:auto}img{max-width:100%}"
    )
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>moeflow lineage report</title>'
        f"<style>{style}</style></head><body>\n{html}\n</body></html>\n"
    )


def generate(start: Path | list[Path], out: Path) -> dict:
    """Write the card, the dataset card, the report and the plots for the artifact(s) at `start`.

    A card artifact at `start` stands for its inputs.
    """
    roots = [Path(p).resolve() for p in (start if isinstance(start, list) else [start])]
    if len(roots) == 1 and (roots[0] / "lineage.json").exists():
        rec = json.loads((roots[0] / "lineage.json").read_text())
        if rec["stage"] == "card":
            roots = [roots[0].parent.parent / inp["path"] for _, inp in sorted(rec["inputs"].items())]
    from moeflow.card import dataset  # it builds on this module

    graph = collect(roots)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train = single(graph, "train")
    metrics = roots[0].parent.parent / "train" / _name(train["artifact"]) / "metrics.jsonl"
    plots.health(metrics, train["config"]["train"], out / "plots")
    fil = single(graph, "filter")
    plots.filter_waterfall(plots.waterfall(fil["stats"], list(fil["config"].get("steps", []))),
                           out / "plots" / plots.WATERFALL)
    card_md, report_md = render_card(graph), render_report(graph)
    (out / CARD).write_text(card_md)
    (out / dataset.DATASET_CARD).write_text(dataset.render(graph))
    (out / REPORT).write_text(report_md)
    (out / DAG).write_text(dag_svg(graph))
    (out / HTML).write_text(render_html(card_md, report_md, out / "plots"))
    return {
        "artifacts": list(graph),
        "card": CARD,
        "dataset_card": dataset.DATASET_CARD,
        "report": REPORT,
        "html": HTML,
        "dag": DAG,
        "plots": list(plots.PLOTS),
    }
