"""Filters give exact reasons; exact dedup keeps the smallest id of each cluster; conservation holds."""

from datatrove.data import Document

from moeflow import filters
from moeflow.configs import DedupConfig, FilterConfig
from moeflow.dedup import exact
from moeflow.documents import DocWriter, iter_docs
from moeflow.lineage.ledger import read as read_ledger

PROSE = (
    "The committee met on a grey morning to discuss the harbour, the new bridge and the price of grain. "
    "Several members argued that the old road should be repaired before any work began on the river crossing. "
    "Others wanted the money spent on the school, whose roof had leaked through the whole of the winter. "
)


def _write(folder, docs):
    folder.mkdir()
    with DocWriter(folder) as w:
        for doc_id, text in docs:
            w.write({"id": doc_id, "source": "s", "domain": "d", "path": "p", "text": text})
    return folder


def test_exact_filter_reasons():
    fs = filters.build(FilterConfig(min_words=20))
    assert filters.judge(fs, Document(text="too few words here", id="a")) == (False, "length.too_short")
    repeated = "\n\n".join(["the same paragraph again and again"] * 30)
    assert filters.judge(fs, Document(text=repeated, id="b")) == (False, "gopher_repetition.dup_para_frac")
    lines = "\n".join(f"line {i} says one thing\nthe same line again" for i in range(20))
    assert filters.judge(fs, Document(text=lines, id="c"))[1] == "gopher_repetition.dup_line_frac"
    assert filters.judge(fs, Document(text=PROSE, id="d")) == (True, "")


def test_filter_stage_accounts_for_every_document(tmp_path):
    src = _write(tmp_path / "in", [("a", PROSE), ("b", "short"), ("c", PROSE + " More.")])
    out = tmp_path / "out"
    out.mkdir()
    stats = filters.run(FilterConfig(min_words=20), src, out)
    assert stats["documents_in"] == 3 and stats["documents_out"] == 2
    assert stats["fates"]["dropped:length.too_short"] == 1
    assert [d["id"] for d in iter_docs(out)] == ["a", "c"]


def test_exact_dedup_normalises_and_keeps_smallest_id(tmp_path):
    src = _write(tmp_path / "in", [("b", PROSE), ("a", PROSE.upper().replace(" ", "  ")), ("c", PROSE + "!")])
    out = tmp_path / "out"
    out.mkdir()
    stats = exact.run(DedupConfig(), src, out)
    assert [d["id"] for d in iter_docs(out)] == ["a", "c"]
    rows = {r["doc_id"]: r for r in read_ledger(out).to_pylist()}
    assert rows["b"]["fate"] == "duplicate" and rows["b"]["detail"] == "a"
    assert stats["duplicate_clusters"] == 1 and stats["cluster_sizes"] == {"2": 1}
