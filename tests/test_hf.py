"""Sources through Hugging Face `datasets` (a saved Dataset, a DatasetDict split, local files by builder)
and the curated corpus out as a dataset with a card generated from lineage."""

from __future__ import annotations

import csv
import gzip
import json
import re
from pathlib import Path

import datasets
import pytest
import yaml
from huggingface_hub import DatasetCard

from moeflow import configs, ingest
from moeflow.card import collect, dataset, single
from moeflow.configs import SourceConfig
from moeflow.core.documents import iter_docs
from moeflow.core.ledger import read as read_ledger
from moeflow.sources import fetch


def _src(**kw) -> SourceConfig:
    return SourceConfig(**{"name": "h", "domain": "x", "license": "cc0", **kw})


def _ingest(tmp_path: Path, *sources: SourceConfig, shards: int = 1, name: str = "out") -> dict:
    from helpers import run_ingest

    out = tmp_path / name
    out.mkdir()
    return run_ingest(sources, out, shards=shards)


def test_saved_datasets_and_files_by_builder(tmp_path):
    """Every record of a saved Dataset, a DatasetDict's split, csv and json files read through `datasets`
    is kept with its text or quarantined with a reason, the same bytes for any shard count."""
    texts = [f"document number {i}, with, commas and \"quotes\"\nand a second line" for i in range(30)]
    datasets.Dataset.from_dict({"text": [*texts[:10], None, ""], "uid": [f"u{i}" for i in range(12)]}
                               ).save_to_disk(str(tmp_path / "ds"), num_shards=3)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": texts[10:20]}),
                          "test": datasets.Dataset.from_dict({"body": ["held out"]})}
                         ).save_to_disk(str(tmp_path / "dd"))
    (tmp_path / "csv").mkdir()
    for k in range(2):
        with open(tmp_path / "csv" / f"{k}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["text", "n"])
            w.writerows([t, i] for i, t in enumerate(texts[20 + 5 * k : 25 + 5 * k]))
    (tmp_path / "bad.json").write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": broken\n')
    sources = [
        _src(name="ds", path=str(tmp_path / "ds"), format="hf_dataset", id_field="uid"),
        _src(name="dd", path=str(tmp_path / "dd"), format="hf_dataset", split="train", text_field="body"),
        _src(name="cs", path=str(tmp_path / "csv" / "*.csv"), format="hf_files", builder="csv"),
        _src(name="js", path=str(tmp_path / "bad.json"), format="hf_files", builder="json"),
    ]
    stats = _ingest(tmp_path, *sources)
    kept = {d["id"]: d["text"] for d in iter_docs(tmp_path / "out")}
    assert [kept[f"ds/u{i}"] for i in range(10)] == texts[:10]
    assert [kept[f"dd/train/data-00000-of-00001.arrow#L{i}"] for i in range(1, 11)] == texts[10:20]
    assert [kept[f"cs/{k}.csv#L{i}"] for k in range(2) for i in range(1, 6)] == texts[20:30]
    rows = {r["doc_id"]: r for r in read_ledger(tmp_path / "out").to_pylist()}
    assert (rows["ds/u10"]["reason"], rows["ds/u11"]["reason"]) == ("bad_text_field", "empty_text")
    assert rows["js/bad.json"]["reason"] == "unreadable_file"  # the parser fails on the file's last line
    assert stats["documents_in"] == len(rows) == len(kept) + sum(r["fate"] == "quarantined" for r in
                                                                 rows.values())
    assert stats["sources"]["ds"]["files"] == 3
    _ingest(tmp_path, *sources, shards=3, name="sharded")
    for f in ("docs.parquet", "ledger.parquet"):
        assert (tmp_path / "out" / f).read_bytes() == (tmp_path / "sharded" / f).read_bytes()


def test_a_hub_name_or_a_wrong_split_fails_before_any_work(tmp_path):
    with pytest.raises(ingest.SourceError, match="never downloads.*save_to_disk"):
        ingest.resolve_source(_src(path="allenai/c4", format="hf_dataset"))
    with pytest.raises(ingest.SourceError, match="never downloads"):
        ingest.resolve_source(_src(path="HuggingFaceFW/fineweb", format="hf_files", builder="parquet"))
    one = datasets.Dataset.from_dict({"text": ["x"]})
    datasets.DatasetDict({"a": one}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ingest.SourceError, match=r"splits \['a'\]"):
        ingest.resolve_source(_src(path=str(tmp_path / "dd"), format="hf_dataset"))
    with pytest.raises(ingest.SourceError, match="not a dataset saved"):
        ingest.resolve_source(_src(path=str(tmp_path), format="hf_dataset"))
    with pytest.raises(ValueError, match="builder"):
        _src(path=str(tmp_path), format="hf_files")


def _package_texts(name: str, pattern: str, n: int) -> list[str]:
    files = sorted(fetch.tree(name).glob(pattern))[:n]
    if not files:
        pytest.skip(f"package {name} is not in the data cache on this machine")
    raw = [gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else f.read_bytes() for f in files]
    return [b.decode() for b in raw]


@pytest.fixture(scope="module")
def hf_run(prefect_server, smoke_data, tmp_path_factory):
    """The smoke preset with its two documentation sources as a saved Dataset, a DatasetDict split and
    csv files read by `datasets`, run to the model card."""
    from helpers import write_config
    from moeflow.flows.pretrain import pretrain

    root = tmp_path_factory.mktemp("hf")
    py = _package_texts("python3.11-doc", "usr/share/doc/python3.11/html/_sources/library/*.rst.txt", 40)
    kernel = _package_texts("linux-doc-6.1", "usr/share/doc/linux-doc-6.1/Documentation/process/*.rst.gz", 40)
    datasets.Dataset.from_dict({"text": py[:25]}).save_to_disk(str(root / "py"), num_shards=2)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": kernel[:36]}),
                          "validation": datasets.Dataset.from_dict({"text": kernel[36:]})}
                         ).save_to_disk(str(root / "kernel"))
    (root / "csv").mkdir()
    with open(root / "csv" / "py.csv", "w", newline="") as f:
        csv.writer(f).writerows([["text"], *([t] for t in py[25:])])
    shakespeare = yaml.safe_load(configs.resolve("smoke").read_text())["sources"][0]
    sources = [shakespeare,
               {"name": "py-saved", "path": str(root / "py"), "format": "hf_dataset", "domain": "python_docs",
                "license": "PSF-2.0"},
               {"name": "py-csv", "path": str(root / "csv" / "*.csv"), "format": "hf_files", "builder": "csv",
                "domain": "python_docs", "license": "PSF-2.0"},
               {"name": "kernel", "path": str(root / "kernel"), "format": "hf_dataset", "split": "train",
                "domain": "kernel_docs", "license": "GPL-2.0-only"}]
    path = write_config(root / "hf.yaml", store=str(root / "store"), sources=sources)
    return path, pretrain(config=str(path)), {"py-saved": 25, "py-csv": len(py) - 25, "kernel": 36}


def _stage(run: dict, stage: str) -> Path:
    return Path(run["stages"][stage]["artifact"])


def test_datasets_sources_run_to_the_model_card(hf_run):
    _, run, records = hf_run
    assert run["card"]
    ing = json.loads((_stage(run, "ingest") / "manifest.json").read_text())["stats"]
    for name, n in records.items():
        assert ing["sources"][name]["documents"] == n, name
    ledger = read_ledger(_stage(run, "ingest")).to_pylist()
    assert len(ledger) == ing["documents_in"] == sum(s["documents"] for s in ing["sources"].values())
    assert sum(r["fate"] == "kept" for r in ledger) == ing["documents_out"]
    card_dir = Path(run["card"]).parent
    assert f"]({dataset.DATASET_CARD})" in (card_dir / "README.md").read_text()
    card = DatasetCard.load(card_dir / dataset.DATASET_CARD)
    assert card.data.task_categories == ["text-generation"]
    assert "Tokens: " in card.text and "not counted" not in card.text


def _table(text: str, heading: str) -> list[list[str]]:
    """The rows of the first Markdown table after `heading`."""
    after = text.split(heading, 1)[1].split("\n\n|", 1)[1]
    lines = ("|" + after).split("\n\n", 1)[0].splitlines()[2:]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


def test_export_writes_a_dataset_and_a_card_matching_lineage(hf_run, tmp_path):
    from moeflow.cli import main

    cfg, run, _ = hf_run
    out = tmp_path / "corpus"
    assert main(["export", str(cfg), "--stage", "decontaminate", str(out)]) == 0
    ds = datasets.load_from_disk(str(out))
    assert ds.column_names == list(dataset.COLUMNS)
    art = _stage(run, "decontaminate")
    docs = list(iter_docs(art))
    assert ds["id"] == [d["id"] for d in docs] and ds["text"] == [d["text"] for d in docs]
    graph = collect([art])
    sources = single(graph, "ingest")["stats"]["sources"]
    licenses = {(n, s["license"]) for n, s in sources.items()}
    assert set(zip(ds["source"], ds["license"], strict=True)) <= licenses
    card = DatasetCard.load(out / "README.md")
    assert card.data.size_categories == [dataset.size_category(len(docs))]
    named = sorted(f"extended|{s['package'] or n}" for n, s in sources.items())
    assert sorted(card.data.source_datasets) == named
    per_stage = _table(card.text, "## Documents per stage")
    for stage, n_in, n_out, _ in per_stage:
        stats = single(graph, stage)["stats"]
        assert (int(n_in), int(n_out)) == (stats["documents_in"], stats["documents_out"]), stage
    assert [r[0] for r in per_stage] == list(dataset.STAGES)
    for row in _table(card.text, "## Sources"):
        s = sources[row[0]]
        want = [s["files"], s["documents"], s["kept"], s["quarantined"], s["bytes"]]
        assert [int(x) for x in row[5:]] == want, row
    by_source = single(graph, "filter")["stats"]["by_source"]
    for row in _table(card.text, "### Filter decisions per source"):
        assert int(row[1]) == by_source[row[0]].get("kept", 0), row
    decon = single(graph, "decontaminate")["stats"].get("per_benchmark", {})
    for row in _table(card.text, "## Benchmark contamination"):
        assert int(row[4]) == decon.get(row[0], {}).get("documents_dropped", 0), row
    assert "not counted" in card.text  # exported from decontaminate: no token counts claimed
    assert main(["export", str(cfg), "--stage", "decontaminate", str(out)]) == 1  # never over a folder
    assert re.search(r"^## Run record", card.text, re.M)
