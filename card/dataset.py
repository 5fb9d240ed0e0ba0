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
from moeflow.card.sections import RUN_RECORD, dedup_section, fates, filter_section, table

DATASET_CARD = "dataset_card.md"
STAGES = ("ingest", "filter", "dedup", "decontaminate")
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
    try:
        rec = single(graph, "tokenize", required=False)
    except ValueError:  # several token stores (never in one run's graph; a hand-made one)
        return None
    return rec if rec and "tokens" in rec["stats"] else None


def metadata(graph: dict[str, dict]) -> DatasetCardData:
    sources = single(graph, "ingest")["stats"]["sources"]
    licenses = sorted({s["license"].lower() for s in sources.values()})
    languages = list((single(graph, "filter", required=False) or {}).get("config", {}).get("languages") or [])
    return DatasetCardData(
        pretty_name=f"moeflow {single(graph, 'ingest')['run_config']} corpus",
        license=licenses[0] if len(licenses) == 1 else "other",
        license_name=None if len(licenses) == 1 else "mixed: " + ", ".join(licenses),
        language=languages or None,
        size_categories=[size_category(_last(graph)["stats"]["documents_out"])],
        source_datasets=[f"extended|{s['package'] or name}" for name, s in sorted(sources.items())],
        task_categories=["text-generation"],
        task_ids=["language-modeling"],
        tags=["moeflow", "pretraining", "deduplicated", "decontaminated"],
    )


def render(graph: dict[str, dict]) -> str:
    """The dataset card of the documents the graph's last data stage kept."""
    last, data = _last(graph), metadata(graph)
    body = [
        f"# {data.pretty_name}",
        "",
        f"The documents kept by the `{last['stage']}` stage of moeflow's `{last['run_config']}` config: "
        f"{last['stats']['documents_out']:,} documents with columns {', '.join(f'`{c}`' for c in COLUMNS)}. "
        "Every figure below is read from the stages' lineage records.",
        *_sources(graph),
        *_per_stage(graph),
        *filter_section((single(graph, "filter", required=False) or {}).get("stats", {})),
        *(dedup_section(single(graph, "dedup")["stats"]) if _has(graph, "dedup") else []),
        *_contamination(graph),
        "",
        "## Known limitations",
        "",
        *_limitations(graph),
        *_run_record(graph),
    ]
    return DatasetCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n").content


def _has(graph: dict[str, dict], stage: str) -> bool:
    return any(r["stage"] == stage for r in graph.values())


def _sources(graph: dict[str, dict]) -> list[str]:
    sources = single(graph, "ingest")["stats"]["sources"]
    rows = [[n, s["package"] or "(user files)", s["version"] or "-", s["license"], s["domain"], s["files"],
             s["documents"], s.get("kept", "-"), s["quarantined"], s.get("bytes", "-")]
            for n, s in sorted(sources.items())]
    head = ["source", "package", "version", "license", "domain", "files", "records", "kept by ingest",
            "quarantined", "UTF-8 bytes read"]
    return ["", "## Sources", "", table(head, rows)]


def _per_stage(graph: dict[str, dict]) -> list[str]:
    rows = [[st, r["stats"]["documents_in"], r["stats"]["documents_out"], fates(r["stats"])]
            for st in STAGES if _has(graph, st) for r in [single(graph, st)]]
    tok = _tokens(graph)
    tokens = (f"Tokens: {tok['stats']['tokens']:,} in the {tok['stats']['documents']:,} documents the token "
              f"store holds (`tokenize-{tok['artifact']['hash']}`), per domain "
              + ", ".join(f"{d} {n:,}" for d, n in tok["stats"].get("tokens_per_domain", {}).items()) + "."
              if tok else "Tokens: not counted (the corpus was exported before tokenization).")
    return ["", "## Documents per stage", "",
            table(["stage", "documents in", "documents out", "removed (fate:reason count)"], rows), "",
            tokens]


def _contamination(graph: dict[str, dict]) -> list[str]:
    if not _has(graph, "decontaminate"):
        return ["", "## Benchmark contamination", "", "Not checked: exported before `decontaminate`."]
    bench, decon = single(graph, "benchmarks")["stats"], single(graph, "decontaminate")["stats"]
    per = decon.get("per_benchmark", {})
    rows = [[b, s["split"], s["items"], s["items_too_short"], per.get(b, {}).get("documents_dropped", 0),
             per.get(b, {}).get("documents_cut", 0), per.get(b, {}).get("chars_removed", 0)]
            for b, s in sorted(bench["benchmarks"].items())]
    head = ["benchmark", "split", "items", "items too short to index", "documents dropped", "documents cut",
            "characters removed"]
    return ["", f"## Benchmark contamination ({bench['ngram']}-gram overlap)", "",
            f"A document sharing an indexed {bench['ngram']}-gram (lower-cased words) with a benchmark item "
            f"was {'dropped' if decon.get('action', 'drop') == 'drop' else 'cut around each match'}.", "",
            table(head, rows)]


def _limitations(graph: dict[str, dict]) -> list[str]:
    fil = single(graph, "filter", required=False)
    langs = (fil or {}).get("config", {}).get("languages")
    sources = single(graph, "ingest")["stats"]["sources"]
    out = [f"- Languages: {', '.join(langs)} only (fastText lid.176)." if langs else
           "- Languages: not identified (`filter.languages` unset: no language was filtered); the card "
           "cannot say which are present.",
           "- Domains: " + ", ".join(sorted({s["domain"] for s in sources.values()})) + " only.",
           "- Licences differ per source (above): each document's `license` column says which applies."]
    if _has(graph, "decontaminate"):
        n = len(single(graph, "benchmarks")["stats"]["benchmarks"])
        out.append(f"- Contamination was checked against {n} benchmarks only; items shorter than the n-gram "
                   "could not be indexed.")
    if _has(graph, "dedup"):
        out.append("- Near-duplicates are those MinHash finds above the configured Jaccard threshold; "
                   "paraphrases below it stay.")
    return out


def _run_record(graph: dict[str, dict]) -> list[str]:
    rows = [[r["stage"], name, r["artifact"]["content_hash"], r["code"]["commit"], r["finished_at"],
             r["seconds"]] for name, r in graph.items()]
    return ["", RUN_RECORD, "", "Timings and times differ between runs; everything above is reproducible.",
            "", table(["stage", "artifact", "content hash", "code commit", "finished at", "seconds"], rows)]


def export(artifact_dir: Path, out: Path) -> dict:
    """Write the documents of a data stage's artifact as a saved dataset (`COLUMNS`) into `out`, with its
    card as `out/README.md`; `out` must not exist. Streams: one record batch at a time."""
    import datasets


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
    from moeflow.core.documents import iter_docs

    for doc in iter_docs(Path(folder)):
        yield {"id": doc["id"], "text": doc["text"], "source": doc["source"], "domain": doc["domain"],
               "license": licenses[doc["source"]]}
