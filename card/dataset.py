"""The curated corpus as a Hugging Face dataset: its card generated from lineage alone, and `moeflow export`.

`render(graph)` is the dataset card (YAML metadata a `huggingface_hub.DatasetCard` parses, then sources,
documents per stage, filter decisions, duplicate clusters, contamination, limitations, and a run record
below the reproducible part). `export(artifact_dir, out)` writes the documents a data stage kept as a
dataset `datasets.load_from_disk(out)` opens, with `README.md` as its card.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from huggingface_hub import DatasetCard, DatasetCardData

from moeflow.card.graph import collect, single
from moeflow.card.render import render as render_template
from moeflow.card.sections import SECONDS, dedup_clusters, edited_tier, filter_table, seconds, stages_table, table
from moeflow.core.documents import iter_docs

DATASET_CARD = "dataset_card.md"
TEMPLATE = "dataset_card.md.j2"
STAGES = ("ingest", "filter", "dedup", "quality", "decontaminate")
COLUMNS = ("id", "text", "source", "domain", "license")
SIZES = ((1e3, "n<1K"), (1e4, "1K<n<10K"), (1e5, "10K<n<100K"), (1e6, "100K<n<1M"), (1e7, "1M<n<10M"),
         (1e8, "10M<n<100M"), (1e9, "100M<n<1B"), (1e10, "1B<n<10B"), (1e11, "10B<n<100B"),
         (1e12, "100B<n<1T"))


def size_category(n: int) -> str:
    """The Hub's `size_categories` value for `n` examples."""
    return next((name for top, name in SIZES if n < top), "n>1T")


def _last(graph: dict[str, dict]) -> dict:
    """THE record of the last data stage the graph holds (the stage whose documents the card describes)."""
    return next(single(graph, st) for st in reversed(STAGES) if any(r["stage"] == st for r in graph.values()))


def _tokens(graph: dict[str, dict]) -> dict | None:
    """What the token store downstream holds, when the graph has exactly one that counted its tokens."""
    try:
        rec = single(graph, "tokenize", required=False)
    except ValueError:  # several token stores (never in one run's graph; a hand-made one)
        return None
    if not rec or "tokens" not in rec["stats"]:
        return None
    per_domain = rec["stats"].get("tokens_per_domain", {})
    return {"total": rec["stats"]["tokens"], "documents": rec["stats"]["documents_out"],
            "artifact": f"tokenize-{rec['artifact']['hash']}",
            "per_domain": ", ".join(f"{d} {n:,}" for d, n in per_domain.items())}


def metadata(graph: dict[str, dict]) -> DatasetCardData:
    sources = single(graph, "ingest")["stats"]["sources"]
    licenses = sorted({s["license"].lower() for s in sources.values()})
    languages = list((single(graph, "filter", required=False) or {}).get("config", {}).get("languages") or [])
    done = [tag for st, tag in (("dedup", "deduplicated"), ("decontaminate", "decontaminated")) if _has(graph, st)]
    return DatasetCardData(
        pretty_name=f"moeflow {single(graph, 'ingest')['run_config']} corpus",
        license=licenses[0] if len(licenses) == 1 else "other",
        license_name=None if len(licenses) == 1 else "mixed: " + ", ".join(licenses),
        language=languages or None,
        size_categories=[size_category(_last(graph)["stats"]["documents_out"])],
        source_datasets=[f"extended|{s['package'] or name}" for name, s in sorted(sources.items())],
        task_categories=["text-generation"],
        task_ids=["language-modeling"],
        tags=["moeflow", "pretraining", *done],
    )


def render(graph: dict[str, dict]) -> str:
    """The dataset card of the documents the graph's last data stage kept."""
    last, data = _last(graph), metadata(graph)
    fil = single(graph, "filter", required=False)
    text = render_template(
        TEMPLATE,
        card_data=data.to_yaml(),
        pretty_name=data.pretty_name,
        last=last,
        columns=", ".join(f"`{c}`" for c in COLUMNS),
        sources_table=_sources_table(graph),
        stages_table=stages_table([single(graph, st) for st in STAGES if _has(graph, st)]),
        tokens=_tokens(graph),
        filter_table=filter_table((fil or {}).get("stats", {})),
        dedup=dedup_clusters(single(graph, "dedup")["stats"]) if _has(graph, "dedup") else None,
        contamination=_contamination(graph),
        classifier=_classifier(graph),
        languages=(fil or {}).get("config", {}).get("languages"),
        domains=sorted({s["domain"] for s in single(graph, "ingest")["stats"]["sources"].values()}),
        licenses=sorted({s["license"] for s in single(graph, "ingest")["stats"]["sources"].values()}),
        run_table=_run_table(graph),
    )
    return DatasetCard(text).content


def _has(graph: dict[str, dict], stage: str) -> bool:
    return any(r["stage"] == stage for r in graph.values())


def _sources_table(graph: dict[str, dict]) -> str:
    sources = single(graph, "ingest")["stats"]["sources"]
    rows = [[n, s["package"] or "(user files)", s["version"] or "-", s["license"], s["domain"], s["files"],
             s["documents"], s.get("kept", "-"), s["quarantined"], s.get("bytes", "-")]
            for n, s in sorted(sources.items())]
    head = ["source", "package", "version", "license", "domain", "files", "records", "kept by ingest",
            "quarantined", "UTF-8 bytes read"]
    return table(head, rows)


def _classifier(graph: dict[str, dict]) -> dict | None:
    """Which classifier selected the corpus: the `quality_model` and `quality` records in words; None without."""
    if not (_has(graph, "quality_model") and _has(graph, "quality")):
        return None
    model, kept = single(graph, "quality_model"), single(graph, "quality")
    ms, held = model["stats"], model["stats"].get("heldout", "not measured")
    syn = model["config"].get("synthetic_negatives", {}).get("kinds")
    coherence, grammar = ms.get("coherence") or {}, ms.get("grammar") or {}
    return {
        "what": "a fastText classifier trained by `quality_model`" if ms["source"] == "trained"
        else f"your fastText classifier `{model['config']['model']}`",
        "artifact": f"quality_model-{model['artifact']['hash']}", "label": ms["label"],
        "positives": ", ".join(f"`{p}`" for p in ms.get("positives", {}).get("sources", [])),
        "negatives": f"degraded versions of them and of a corpus sample ({', '.join(syn)})" if syn
        else "a sample of the corpus",
        "heldout": held if isinstance(held, str) else
        f"precision {held['precision']}, recall {held['recall']}, ROC AUC {held['roc_auc']} "
        f"({held['positives']} clean, {held['negatives']} junk documents)",
        "rule": json.dumps(kept["config"]["keep"]) + (
            f", overrides {json.dumps(kept['config']['overrides'])}" if kept["config"].get("overrides") else ""),
        "coherence": f"threshold {coherence['threshold']}, the {coherence['clean_loss']} quantile of "
        f"{coherence['documents']} corpus documents" if coherence.get("threshold") else "",
        "grammar": f"threshold {grammar['threshold']}: zero, or the {grammar['clean_loss']} quantile of "
        f"{grammar['documents']} corpus documents where lower" if grammar.get("threshold") is not None else "",
        "kept": ", ".join(f"{d} {v['kept']:,} of {v['documents']:,}" for d, v in kept["stats"]["by_domain"].items()),
    }


def _contamination(graph: dict[str, dict]) -> dict | None:
    """The n-gram, the action taken and a table per benchmark; None when exported before decontaminate."""
    if not _has(graph, "decontaminate"):
        return None
    bench, decon = single(graph, "benchmarks")["stats"], single(graph, "decontaminate")["stats"]
    per = decon.get("per_benchmark", {})
    rows = [[b, s["split"], s["items"], s["items_too_short"],
             *(per.get(b, {}).get(k, 0) for k in ("documents_dropped", "documents_cut", "flagged_ngram",
                                                   "flagged_edited", "chars_removed"))]
            for b, s in sorted(bench["benchmarks"].items())]
    head = ["benchmark", "split", "items", "items too short to index", "documents dropped", "documents cut",
            "flagged: intact n-gram", "flagged: edited item", "characters removed"]
    return {"ngram": bench["ngram"], "dropped": decon.get("action", "drop") == "drop",
            "edited": edited_tier(single(graph, "decontaminate")["config"]),
            "benchmarks": len(bench["benchmarks"]), "table": table(head, rows)}


def _run_table(graph: dict[str, dict]) -> str:
    rows = [[r["stage"], name, r["artifact"]["content_hash"], r["code"]["commit"], r["finished_at"],
             seconds(r)] for name, r in graph.items()]
    return table(["stage", "artifact", "content hash", "code commit", "finished at", SECONDS], rows)


def export(artifact_dir: Path, out: Path) -> dict:
    """Write the documents of a data stage's artifact as a saved dataset (`COLUMNS`) into `out`, with its
    card as `out/README.md`; `out` must not exist. Streams: one record batch at a time."""
    import datasets  # ~1 s to import: only `moeflow export` needs it, not every card

    artifact_dir, out = Path(artifact_dir).resolve(), Path(out)
    graph = collect([artifact_dir])
    stage = json.loads((artifact_dir / "lineage.json").read_text())["stage"]
    if stage not in STAGES:  # the stages whose artifact is documents
        raise ValueError(f"{artifact_dir} is a `{stage}` artifact; export takes one of "
                         + ", ".join(STAGES))
    if out.exists():
        raise FileExistsError(f"{out} exists: export writes a new folder (remove it or choose another)")
    licenses = {n: s["license"] for n, s in single(graph, "ingest")["stats"]["sources"].items()}
    features = datasets.Features({c: datasets.Value("string") for c in COLUMNS})
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        ds = datasets.Dataset.from_generator(
            _rows, features=features, cache_dir=tmp,
            gen_kwargs={"folder": str(artifact_dir), "licenses": licenses})
        ds.save_to_disk(str(out))
        del ds  # its cache files in `tmp` closed before the folder goes
    (out / "README.md").write_text(render(graph))
    return {"documents": single(graph, stage)["stats"]["documents_out"], "path": str(out)}


def _rows(folder: str, licenses: dict[str, str]):
    for doc in iter_docs(Path(folder)):
        yield {"id": doc["id"], "text": doc["text"], "source": doc["source"], "domain": doc["domain"],
               "license": licenses[doc["source"]]}
