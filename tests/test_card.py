"""The card and report from synthetic lineage records: an entry per artifact, nothing read but lineage."""

import json
import re
from pathlib import Path

import pytest

from moeflow import card
from moeflow.configs import TokenizerConfig
from moeflow.core.documents import DocWriter
from moeflow.tokenize import store as token_store
from moeflow.tokenize import tokenizer

RUNGS = 5


class Store:
    """Writes `<root>/<stage>/<stage>-<hash>/lineage.json` records with increasing times."""

    def __init__(self, root: Path):
        self.root, self.clock = root, 0

    def add(self, stage, key, inputs=(), config=None, stats=None, content=None, previous=None) -> dict:
        start, self.clock = self._time(), self.clock + 1
        rec = {"stage": stage, "config": config or {}, "operational": {}, "run_config": "synthetic",
               "inputs": {name: {"stage": r["stage"], "hash": r["artifact"]["hash"],
                                 "content_hash": r["artifact"]["content_hash"],
                                 "path": f"{r['stage']}/{r['stage']}-{r['artifact']['hash']}"}
                          for name, r in dict(inputs).items()},
               "code": {"commit": "c0ffee", "dirty": False, "source_hash": f"src-{stage}"},
               "prefect": {}, "host": {"hostname": "h", "platform": "linux", "cpus": 4},
               "started_at": start, "finished_at": self._time(), "seconds": 1.0, "stats": stats or {},
               "artifact": {"stage": stage, "hash": key,
                            "content_hash": content or f"content-{stage}-{key}"},
               "previous": previous}
        self.clock += 1
        folder = self.root / stage / f"{stage}-{key}"
        folder.mkdir(parents=True)
        (folder / "lineage.json").write_text(json.dumps(rec, indent=2))
        return rec

    def folder(self, rec: dict) -> Path:
        return self.root / rec["stage"] / f"{rec['stage']}-{rec['artifact']['hash']}"

    def _time(self) -> str:
        return f"2024-01-01T00:{self.clock // 60:02d}:{self.clock % 60:02d}+00:00"


def _data_stats(n: int) -> dict:
    return {"documents_in": n, "documents_out": n, "fates": {"kept": n}}


TOKENIZE_STATS = {"documents_in": 4, "documents_out": 4, "tokens": 40, "shards": 2, "by_shard": [
    {"shard": 0, "documents": 3, "tokens": 30, "sources": {"lit": 2, "py": 1}, "first_rows": [
        {"row": 0, "doc_id": "lit/a", "tokens": 10, "path": "cache:packages/lit/a.txt"},
        {"row": 1, "doc_id": "lit/b", "tokens": 10, "path": "cache:packages/lit/b.txt"},
        {"row": 2, "doc_id": "py/c", "tokens": 10, "path": "/user/py/c.rst"}]},
    {"shard": 1, "documents": 1, "tokens": 10, "sources": {"py": 1}, "first_rows": [
        {"row": 0, "doc_id": "py/d", "tokens": 10, "path": "/user/py/d.rst"}]}]}
PHASE = {"name": "main", "phase": 0, "seq_len": 8, "start_step": 0, "steps": 4,
         "weights": {"lit": 0.5, "py": 0.5},
         "target_tokens": {"lit": 64, "py": 64}, "tokens_per_domain": {"lit": 64, "py": 64},
         "epochs_after": {"lit": 1.0, "py": 1.0}}
MIX_STATS = {"phases": [PHASE], "batch_size": 2, "heldout_documents": {"lit": 1, "py": 1},
             "train_tokens_per_domain": {"lit": 64, "py": 64},
             "plan": {d: {"documents": 2, "training_tokens_available": 64, "tokens": 64, "epochs": 1.0}
                      for d in ("lit", "py")}}
MODEL = {"n_layers": 2, "d_model": 16, "n_heads": 2, "num_experts": 4, "top_k": 2, "expert_hidden": 32,
         "shared_expert_hidden": 0, "capacity_factor": None, "backend": "torch"}
TRAIN_CFG = {"steps": 4, "warmup_steps": 1, "schedule": "cosine"}


def _train_stats(loss: float) -> dict:
    return {"params_total": 1000, "params_active": 600, "token_drop_rate": 0.0, "vocab_size": 300,
            "steps": 4,
            "tokens": 64, "batch_size": 2, "initial_loss": 5.0, "final_loss": loss, "tail_loss": loss,
            "tokens_per_s": 10.0, "mfu": None}


def build_pipeline(s: Store) -> dict:
    """Every stage the card reads, the ladder's five rungs each with its own mix; returns records by name."""
    sources = {n: {"package": n, "version": "1", "license": "MIT", "domain": n, "files": 1, "documents": 2,
                   "quarantined": 0} for n in ("lit", "py")}
    r = {"ingest": s.add("ingest", "i1", stats={**_data_stats(4), "sources": sources})}
    r["filter"] = s.add("filter", "f1", {"docs": r["ingest"]}, {"languages": None}, _data_stats(4))
    r["dedup"] = s.add("dedup", "d1", {"docs": r["filter"]}, {}, _data_stats(4))
    r["benchmarks"] = s.add("benchmarks", "b1", config={"max_items_per_ngram": 10, "min_alpha_words": 3},
                            stats={"ngram": 8, "benchmarks": {"hx": {"split": "test", "items": 3,
                                                                     "items_too_short": 0, "ngrams": 30}}})
    r["decontaminate"] = s.add("decontaminate", "x1", {"docs": r["dedup"], "index": r["benchmarks"]},
                               {"ngram": 8}, _data_stats(4))
    r["tokenizer"] = s.add("tokenizer", "t1", {"docs": r["decontaminate"]}, {"kind": "bpe"}, {"kind": "bpe"})
    r["tokenize"] = s.add("tokenize", "k1", {"docs": r["decontaminate"], "tokenizer": r["tokenizer"]},
                          {"shard_tokens": 30}, TOKENIZE_STATS)
    r["mix"] = s.add("mix", "m1", {"shards": r["tokenize"], "tokenizer": r["tokenizer"]},
                     {"mix": {"weights": {"lit": 0.5, "py": 0.5}}}, MIX_STATS,
                     previous={"artifact": "mix-m0",
                               "config": {"mix": {"weights": {"lit": 0.7, "py": 0.3}}}})
    rungs = {}
    for i in range(RUNGS):
        rm = s.add("rung_mix", f"rm{i}", {"shards": r["tokenize"], "tokenizer": r["tokenizer"]},
                   {"steps": i + 1})
        rungs[f"rung{i}"] = s.add("rung", f"r{i}", {"mix": rm, "tokenizer": r["tokenizer"]},
                                  {"model": {**MODEL, "d_model": 8 * (i + 1)}}, _train_stats(5.0 - i / 10))
    lad = [{"d_model": 8 * (i + 1), "n_layers": 2, "params_active": 100 * (i + 1), "steps": i + 1,
            "flops": 1e6 * (i + 1), "final_loss": 5.0 - i / 10} for i in range(RUNGS)]
    r["ladder"] = s.add("ladder", "l1", rungs, {}, {
        "rungs": lad, "ladder_fraction": 0.1, "predicted_final_loss": 4.0, "band": [3.8, 4.2],
        "fit": {"E": 3.0, "A": 1.0, "alpha": 0.3, "residual_rms": 0.01, "bootstrap_fits": 20},
        "registered_at": "2024-01-01T00:00:59+00:00"})
    r["train"] = s.add("train", "tr1",
                       {"mix": r["mix"], "tokenizer": r["tokenizer"], "prediction": r["ladder"]},
                       {"model": MODEL, "train": TRAIN_CFG}, _train_stats(4.0))
    r["evaluate"] = s.add("evaluate", "e1", {"checkpoint": r["train"], "mix": r["mix"]}, {}, {"heldout": {
        d: {"loss": 4.1, "perplexity": 60.3, "sequences": 2, "tokens": 16} for d in ("lit", "py")}})
    metrics = [{"step": i, "ce": 5.0 - i / 4, "lr": 0.01, "grad_norm": 1.0, "load_imbalance": [1.1, 1.2],
                "token_drop_rate": 0.0, "tokens_per_expert": [[4, 4, 4, 4], [5, 3, 4, 4]]} for i in range(4)]
    (s.folder(r["train"]) / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return r


@pytest.fixture
def pipeline(tmp_path):
    s = Store(tmp_path / "store")
    return s, build_pipeline(s)


def test_every_rung_and_its_mix_appear_once_per_artifact(pipeline):
    s, r = pipeline
    graph = card.collect([s.folder(r["evaluate"])])
    assert [rec["stage"] for rec in graph.values()].count("rung") == RUNGS
    assert [rec["stage"] for rec in graph.values()].count("rung_mix") == RUNGS
    names = list(graph)
    assert names.index("ladder-l1") > max(names.index(f"rung-r{i}") for i in range(RUNGS))
    assert all(names.index(f"rung_mix-rm{i}") < names.index(f"rung-r{i}") for i in range(RUNGS))
    svg = card.dag_svg(graph)
    assert svg.count(">rung</text>") == RUNGS and svg.count(">rung_mix</text>") == RUNGS
    assert svg.count("marker-end") == sum(len(rec["inputs"]) for rec in graph.values())  # ladder: 5
    report = card.render_report(graph)
    assert len(re.findall(r"^## rung: `rung-r\d`$", report, re.M)) == RUNGS
    assert "Artifacts, upstream first: " in report and " → ".join(graph) in report
    text = card.render_card(graph)
    assert len(re.findall(r"^\| rung \| rung-r\d \|", text, re.M)) == RUNGS  # the run record's table


def test_a_unique_stage_twice_fails_clearly(pipeline):
    s, r = pipeline
    graph = card.collect([s.folder(r["evaluate"])])
    assert card.single(graph, "train") is graph["train-tr1"]
    assert card.single(graph, "overlap", required=False) is None
    with pytest.raises(ValueError, match=r"5 `rung` artifacts.*rung-r0"):
        card.single(graph, "rung")
    with pytest.raises(KeyError, match="overlap"):
        card.single(graph, "overlap")


def test_an_upstream_rebuilt_with_equal_content_appears_once_the_newest(pipeline):
    s, r = pipeline
    # the tokenizer rebuilt (new code) with equal content: tokenize is reused and still records the old one
    new_tok = s.add("tokenizer", "t2", {"docs": r["decontaminate"]}, {"kind": "bpe"}, {"kind": "bpe"},
                    content=r["tokenizer"]["artifact"]["content_hash"])
    mix2 = s.add("mix", "m2", {"shards": r["tokenize"], "tokenizer": new_tok}, {"mix": {}}, MIX_STATS)
    graph = card.collect([s.folder(mix2)])
    assert [n for n, rec in graph.items() if rec["stage"] == "tokenizer"] == ["tokenizer-t2"]
    assert list(graph).index("tokenizer-t2") < list(graph).index("tokenize-k1")  # edge by content
    # filter 1, dedup 1, decontaminate 2, tokenizer-t2 1, tokenize 2 (its old tokenizer read as t2), mix 2
    assert card.dag_svg(graph).count("marker-end") == 9


def test_config_diff_reads_the_recorded_previous_artifact(pipeline):
    s, r = pipeline
    changes = ["`mix.weights.lit`: 0.7 → 0.5", "`mix.weights.py`: 0.3 → 0.5"]
    assert card.config_diff(r["mix"]) == ("mix-m0", changes)
    assert card.config_diff(r["train"]) == (None, [])
    report = card.render_report(card.collect([s.folder(r["evaluate"])]))
    assert "- config against the previous `mix` artifact `mix-m0`: `mix.weights.lit`: 0.7 → 0.5" in report
    assert "- no earlier `train` artifact had finished when this one started" in report
    assert f"- content hash: `{r['train']['artifact']['content_hash']}`; code `src-train`" in report
    same = {**r["mix"], "previous": {"artifact": "mix-m0", "config": r["mix"]["config"]}}
    assert card.config_diff(same) == ("mix-m0", [])


def test_drill_down_reads_the_tokenize_record(pipeline):
    _, r = pipeline
    out = card.drill_down({"tokenize-k1": r["tokenize"]})
    assert "- `tokenize-k1/shard-00000.arrow`: 3 documents, 30 tokens (lit 2, py 1)" in out
    assert "  - row 2: `py/c` (10 tokens) from `/user/py/c.rst`" in out
    assert "  - row 0: `py/d` (10 tokens) from `/user/py/d.rst`" in out
    assert len(card.drill_down({"tokenize-k1": r["tokenize"]}, per_shard=1)) == len(out) - 2
    assert card.drill_down({"mix-m1": r["mix"]}) == []


def test_tokenize_records_what_the_drill_down_shows(tmp_path):
    docs, tok_dir, out = tmp_path / "docs", tmp_path / "tok", tmp_path / "out"
    for d in (docs, tok_dir, out):
        d.mkdir()
    with DocWriter(docs) as w:
        for i in range(10):
            w.write({"id": f"s{i % 2}/doc{i}", "source": f"s{i % 2}", "domain": "a", "path": f"/raw/{i}.txt",
                     "text": "alpha beta gamma delta " * (20 + i)})
    tokenizer.build(TokenizerConfig(kind="bpe", vocab_size=600), docs, tok_dir)
    stats = token_store.run(TokenizerConfig(shard_tokens=200), docs, tok_dir, out)
    shards = stats["by_shard"]
    assert len(shards) == stats["shards"] > 1 and sum(s["documents"] for s in shards) == 10
    assert sum(s["tokens"] for s in shards) == stats["tokens"]
    assert all(set(s) == {"shard", "documents", "tokens", "sources", "first_rows"} for s in shards)
    assert all(len(s["first_rows"]) == min(3, s["documents"]) for s in shards)
    first = shards[0]["first_rows"][0]
    assert first == {"row": 0, "doc_id": "s0/doc0", "tokens": first["tokens"], "path": "/raw/0.txt"}
    rec = {"stage": "tokenize", "artifact": {"stage": "tokenize", "hash": "k"}, "stats": stats}
    line = f"  - row 0: `s0/doc0` ({first['tokens']} tokens) from `/raw/0.txt`"
    assert line in card.drill_down({"tokenize-k": rec})


def test_generate_is_independent_of_other_artifacts_in_the_store(pipeline, tmp_path):
    s, r = pipeline
    card.generate([s.folder(r["evaluate"])], tmp_path / "first")
    s.clock = 0  # an unrelated mix and tokenize that finished before these started, and some that came later
    s.add("mix", "early", config={"mix": {"weights": {"lit": 0.9}}}, stats=MIX_STATS)
    s.add("tokenize", "early", config={"shard_tokens": 1}, stats={"by_shard": []})
    s.clock = 10_000
    s.add("mix", "late", config={"mix": {"weights": {"lit": 0.1}}}, stats=MIX_STATS)
    s.add("train", "late", {"mix": r["mix"]}, {"model": MODEL, "train": TRAIN_CFG}, _train_stats(1.0))
    card.generate([s.folder(r["evaluate"])], tmp_path / "second")
    files = sorted(p.relative_to(tmp_path / "first") for p in (tmp_path / "first").rglob("*") if p.is_file())
    assert {card.CARD, "dataset_card.md", card.REPORT, card.HTML, card.DAG} <= {str(f) for f in files}
    for f in files:
        assert (tmp_path / "first" / f).read_bytes() == (tmp_path / "second" / f).read_bytes(), f
    report = (tmp_path / "first" / card.REPORT).read_text()
    assert "`mix-m0`" in report and "mix-early" not in report and "mix-late" not in report


def test_a_sharded_stage_shows_its_wall_time_and_its_parts_total(tmp_path):
    """The run record of a sharded stage is its time from the first part's start to the join's end, with its
    parts' seconds summed, not the join's own fraction of a second."""
    from helpers import _fresh_store, stage_config
    from moeflow.card.sections import seconds
    from moeflow.configs import SourceConfig
    from moeflow.store.local import Manifest
    from moeflow.tasks.runner import materialize

    (tmp_path / "in").mkdir()
    for i in range(6):
        (tmp_path / "in" / f"{i}.txt").write_text(f"document {i} " * 50)
    src = SourceConfig(name="t", path=str(tmp_path / "in" / "*.txt"), domain="x", license="cc0")
    cfg = stage_config(_fresh_store(tmp_path / "out"), 3, sources=(src,))
    joined = materialize("ingest", cfg, {})
    rec = joined.lineage()
    parts = [Manifest.read(Path(joined.path).parent.parent / p["path"]).lineage() for p in rec["shards"]]
    assert len(parts) == 3
    assert rec["parts_seconds"] == round(sum(p["seconds"] for p in parts), 2)
    # started_at and finished_at are to the second
    assert rec["wall_seconds"] + 1 >= max(p["seconds"] for p in parts) and rec["wall_seconds"] + 1 >= rec["seconds"]
    assert seconds(rec).startswith(f"{rec['wall_seconds']} wall") and f"{rec['parts_seconds']} in parts" in seconds(rec)


def test_the_held_out_section_names_the_documents_each_loss_covers_and_what_training_holds_of_them(pipeline):
    s, r = pipeline
    leak = {"doc_id": "lit/ab_folio", "domain": "lit", "ngrams": 400, "in_training": 120, "share": 0.3,
            "top_training_doc": "lit/ab_modern", "top_shared": 118}
    quiet = {"doc_id": "py/c", "domain": "py", "ngrams": 300, "in_training": 0, "share": 0.0,
             "top_training_doc": None, "top_shared": 0}
    mix = {"heldout_leakage": {
        "ngram": 13, "max_leak": 0.02, "group_by": "^(lit/[a-z]+)_", "leaks": [leak], "largest": [leak, quiet],
        "per_domain": {"lit": {"documents": 1, "ngrams": 400, "in_training": 120, "share": 0.3},
                       "py": {"documents": 1, "ngrams": 300, "in_training": 0, "share": 0.0}}}}
    ev = {"heldout": {d: {"loss": 4.1, "perplexity": 60.3, "sequences": 2, "tokens": 16, "documents": 1,
                          "heldout_documents": 3} for d in ("lit", "py")}}
    for rec, stats in ((r["mix"], mix), (r["evaluate"], ev)):
        path = s.folder(rec) / "lineage.json"
        record = json.loads(path.read_text())
        record["stats"].update(stats)
        path.write_text(json.dumps(record))
    text = card.render_card(card.collect([s.folder(r["evaluate"])]))
    assert "| lit | 4.1 | 60.3 | 2 | 16 | 1 of 3 | 30.0% | yes |" in text
    assert "| py | 4.1 | 60.3 | 2 | 16 | 1 of 3 | 0.0% | yes |" in text
    assert "held out by group, by a hash of the group's key (`mix.heldout.group_by`: `^(lit/[a-z]+)_`" in text
    assert ("⚠ 1 held-out document(s) share more than 2.0% of their n-grams with training documents, so their "
            "domain's held-out loss overstates generalisation: lit/ab_folio.") in text
    assert "| `lit/ab_folio` | lit | 30.0% | `lit/ab_modern` | 118 |" in text
    assert "`py/c`" not in text  # only the leaks, when there are any


def test_the_waterfall_gives_every_source_the_same_columns():
    """A drop no configured step names is an "other" column for every source, 0 where a source has none."""
    from moeflow.card import plots

    stats = {"by_source": {
        "a": {"kept": 5, "dropped:length.too_short": 2, "dropped:manual.blocklist": 1},
        "b": {"kept": 4, "dropped:length.too_short": 1},
    }}
    rows = plots.waterfall(stats, ["length"], {"by_source": {"a": {"kept": 4, "dropped:quality.x": 1},
                                                             "b": {"kept": 3, "dropped:quality.x": 0}}})
    assert [[s for s, _, _ in r] for r in rows.values()] == [["read", "length", "other", "dedup", "quality"]] * 2
    assert rows["a"][2] == ("other", 1, 5) and rows["b"][2] == ("other", 0, 4)


def test_a_resume_is_costed_in_the_card():
    """A resume names the steps it trained again, their tokens, FLOPs and seconds; one recorded before restarts
    were costed names its step alone."""
    from moeflow.card.model_card import _resume

    line = _resume({"from_step": 8, "recomputed_steps": 2, "recomputed_tokens": 4096, "recomputed_flops": 1.5e9,
                    "recomputed_seconds": 0.42})
    assert line == "from step 8: 2 steps trained again, 4,096 tokens, 1.5e+09 FLOPs, 0.42 s"
    assert _resume({"from_step": 8}) == "from step 8"


def test_health_is_tabled_per_phase_and_layer():
    from moeflow.card.training import phase_health_table

    text = phase_health_table({"health_by_phase": [
        {"phase": 0, "seq_len": 64, "steps": 30, "token_drop_rate": 0.0, "load_imbalance": [1.21, 1.4]},
        {"phase": 1, "seq_len": 256, "steps": 10, "token_drop_rate": 0.012, "load_imbalance": [1.3, 1.55]}]})
    assert "| 1 | 256 | 10 | 0.012 | 1.3, 1.55 |" in text
    assert phase_health_table({}) == ""  # a run recorded before: no table


def test_the_health_table_counts_alarms_by_rule_and_action():
    """An alarm names its rule and action; one recorded before they were (text only) is counted by its prefix."""
    from moeflow.card import training

    alarms = [{"step": 3, "alarm": "grad_norm_ceiling: 3.1 > ceiling 3.0", "rule": "grad_norm_ceiling",
               "reading": 3.1, "action": "log"}, {"step": 9, "alarm": "loss_spike: 9.0 > 1.50 x median 2.0"}]
    shown = training.health_table({"token_drop_rate": 0.0, "alarms": alarms})
    assert "grad_norm_ceiling (log) x1, loss_spike x1. First: step 3: grad_norm_ceiling: 3.1 > ceiling 3.0" in shown
