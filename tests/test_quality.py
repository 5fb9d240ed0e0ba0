"""The quality classifier and the quality stage: planted junk is dropped with its score, conservation, the same
bytes for any shard count, a deterministic model for a seed, a given model used as is, bad input named."""

import json
import math
import random
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pydantic
import pytest

from helpers import _fresh_store, docs_artifact, stage_config
from moeflow import configs, quality
from moeflow.configs import ConfigError, KeepRule, QualityConfig
from moeflow.core.documents import DocWriter, iter_docs
from moeflow.core.ledger import read as read_ledger
from moeflow.tasks.runner import materialize

WORDS = ("river harbour bridge committee morning winter school roof grain market village council teacher "
         "garden library museum letter journey mountain forest valley history science music painter").split()
SPAM = "buy cheap pills now click here free casino bonus win money fast best price discount offer".split()


PROSE = ("The {} near the {} was described in a long letter about the {}, and everyone agreed that it had "
         "changed since the old days.")


def _prose(rng: random.Random, sentences: int = 12, words: list[str] = WORDS, template: str = PROSE) -> str:
    return " ".join(template.format(*rng.sample(words, 3)) for _ in range(sentences))


def _spam(rng: random.Random) -> str:
    return " ".join(rng.choice(SPAM) for _ in range(150))


def _positives(folder: Path, n: int, seed: int = 1) -> configs.PositiveSource:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (folder / f"pos{i:03d}.txt").write_text(_prose(rng))
    return configs.PositiveSource(name="reference", path=str(folder / "*.txt"))


def _corpus(folder: Path, n_good: int = 30, n_junk: int = 12) -> Path:
    """Prose and spam in two domains, spam at every fourth row or so (ids say which)."""
    rng = random.Random(7)
    folder.mkdir(parents=True)
    rows = [(f"good{i:03d}", _prose(rng)) for i in range(n_good)]
    rows += [(f"junk{i:03d}", _spam(rng)) for i in range(n_junk)]
    random.Random(3).shuffle(rows)
    with DocWriter(folder) as w:
        for i, (doc_id, text) in enumerate(rows):
            domain = "news" if i % 2 else "forum"
            w.write({"id": doc_id, "source": f"{domain}-src", "domain": domain, "path": "p", "text": text})
    return folder


def _ids(corpus: Path, domain: str) -> set[str]:
    return {d["id"] for d in iter_docs(corpus) if d["domain"] == domain}


def _run(tmp_path: Path, q: QualityConfig, shards: int = 1, corpus: Path | None = None) -> dict:
    """quality_model then quality, in a fresh store: their manifests."""
    out = tmp_path / f"out{shards}-{random.random()}"
    store = _fresh_store(out)
    cfg = stage_config(store, shards, quality=q)
    docs = docs_artifact(store, corpus or _corpus(tmp_path / f"corpus-{out.name}"))
    model = materialize("quality_model", cfg, {"docs": docs})
    return {"model": model, "quality": materialize("quality", cfg, {"docs": docs, "model": model})}


@pytest.fixture
def positives(tmp_path):
    return (_positives(tmp_path / "pos", 30),)


DCLM = configs.SyntheticNegatives(kinds=())  # positives against the corpus sample, as DCLM published it


CLASSIFIER_ONLY = {"grammar": configs.Grammar(clean_loss=0)}  # the spam and reversed text is ungrammatical too


def test_planted_junk_is_dropped_with_its_score(tmp_path, positives):
    built = _run(tmp_path, QualityConfig(positives=positives, keep=KeepRule(threshold=0.5), synthetic_negatives=DCLM,
                                         **CLASSIFIER_ONLY))
    stats = built["quality"].stats
    assert stats["documents_in"] == 42 and sum(stats["fates"][f] for f in ("kept", "dropped")) == 42
    rows = read_ledger(built["quality"].dir).to_pylist()
    dropped = {r["doc_id"]: r for r in rows if r["fate"] == "dropped"}
    assert set(dropped) == {f"junk{i:03d}" for i in range(12)}
    for r in dropped.values():
        assert r["reason"] == "quality.below_threshold"
        detail = json.loads(r["detail"])
        assert detail["score"] < 0.5 and detail["threshold"] == 0.5
    assert all(json.loads(r["detail"])["score"] >= 0.5 for r in rows if r["fate"] == "kept")
    assert [d["id"] for d in iter_docs(built["quality"].dir)] == [r["doc_id"] for r in rows if r["fate"] == "kept"]
    held = built["model"].stats["heldout"]  # negatives are the corpus, prose and spam alike (DCLM's recipe)
    assert held["positives"] == 6 and held["negatives"] == 6 and 0 <= held["roc_auc"] <= 1


RAIL = "Every {} on this line is checked by a {} before a {} may leave the yard for its morning run."
OTHER = ("engine wheel track signal station driver cargo freight platform tunnel carriage timetable ticket "
         "conductor junction rail depot lever brake whistle boiler coal siding viaduct").split()


def _reversed(text: str) -> str:
    """A junk kind neither `quality/degrade.py` nor the benchmark makes: every word, in reverse order."""
    return " ".join(reversed(text.split()))


def test_degraded_text_of_any_domain_is_dropped_with_its_score(tmp_path, positives):
    """Positives in one style, a corpus in two (one of them unlike the positives) with three reversed documents
    planted in each: trained with synthetic negatives the classifier ranks exactly the planted ones last in
    their domains (positives against the corpus alone teach style and topic, and rank the rail ones anywhere)."""
    rng, rows = random.Random(5), []
    for domain, words, template in (("news", WORDS, PROSE), ("rail", OTHER, RAIL)):
        for i in range(33):
            text = _prose(rng, words=words, template=template)
            rows.append((f"{domain}-{'junk' if i < 3 else 'good'}{i:02d}", domain, _reversed(text) if i < 3 else text))
    random.Random(3).shuffle(rows)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    with DocWriter(corpus) as w:
        for doc_id, domain, text in rows:
            w.write({"id": doc_id, "source": f"{domain}-src", "domain": domain, "path": "p", "text": text})
    keep = KeepRule(top_fraction=30 / 33)
    q = QualityConfig(positives=positives, train=configs.ClassifierTrain(epoch=30, lr=0.5, negatives_per_positive=2),
                      overrides={"news": keep, "rail": keep}, **CLASSIFIER_ONLY)
    built = _run(tmp_path, q, corpus=corpus)
    ledger = read_ledger(built["quality"].dir).to_pylist()
    dropped = {r["doc_id"]: json.loads(r["detail"]) for r in ledger if r["fate"] == "dropped"}
    assert sorted(dropped) == sorted(i for i, _, _ in rows if "junk" in i)
    kept = [json.loads(r["detail"])["score"] for r in ledger if r["fate"] == "kept"]
    assert max(d["score"] for d in dropped.values()) <= min(kept)
    assert all(r["reason"] == "quality.below_threshold" for r in ledger if r["fate"] == "dropped")
    held = built["model"].stats["heldout"]  # clean held-out text against its degraded versions
    assert held["roc_auc"] > 0.75 and held["negatives"] == held["positives"]  # patchwork of templates reads well
    # the clean-loss quantiles: every sampled corpus document, scored by a model that never saw it (the held-out
    # fifth by the classifier, the rest by models trained without their fold), not the held-out fifth alone
    corpus = built["model"].stats["corpus"]
    assert held["corpus_scored"] == corpus["documents"] == corpus["train"] + corpus["heldout"] == 60


def test_roc_auc_counts_pairs_ordered_and_ties_half():
    import numpy as np

    from moeflow.quality.classifier import roc_auc

    assert roc_auc(np.array([0.9, 0.8]), np.array([0.1, 0.2])) == 1.0
    assert roc_auc(np.array([0.1]), np.array([0.9, 0.8])) == 0.0
    assert roc_auc(np.array([0.5, 0.9]), np.array([0.5, 0.1])) == 0.875  # 3 pairs won, 1 tied, of 4


def test_output_is_the_same_bytes_for_any_shard_count(tmp_path, positives):
    q = QualityConfig(positives=positives, keep=KeepRule(top_fraction=0.7), overrides={"news": KeepRule(threshold=0.3)})
    corpus = _corpus(tmp_path / "corpus")
    one, three = _run(tmp_path, q, 1, corpus)["quality"], _run(tmp_path, q, 3, corpus)["quality"]
    for name in ("docs.parquet", "ledger.parquet", "scores.parquet"):
        assert (one.dir / name).read_bytes() == (three.dir / name).read_bytes(), name
    assert one.stats["fates"] == three.stats["fates"] and three.stats["shards"] == 3
    assert one.stats["by_source"] == three.stats["by_source"]
    forum = one.stats["by_domain"]["forum"]
    assert forum["kept"] == math.ceil(0.7 * forum["documents"])  # exactly the top fraction, ties by id
    assert sum(forum["histogram"]) == forum["documents"]
    scores = {r["doc_id"]: (r["fate"], json.loads(r["detail"])["score"]) for r in read_ledger(one.dir).to_pylist()}
    kept = sorted((s, i) for i, (f, s) in scores.items() if f == "kept" and i in _ids(corpus, "forum"))
    dropped = sorted(((-s, i) for i, (f, s) in scores.items() if f == "dropped" and i in _ids(corpus, "forum")))
    assert forum["borderline"] == {"above": [[i, s] for s, i in kept[:5]], "below": [[i, -s] for s, i in dropped[:5]]}


def test_a_trained_model_has_the_same_bytes_for_a_seed(tmp_path, positives):
    corpus = _corpus(tmp_path / "corpus")
    q = QualityConfig(positives=positives)
    a, b = (_run(tmp_path, q, 1, corpus)["model"] for _ in range(2))
    assert a.dir != b.dir and (a.dir / "model.bin").read_bytes() == (b.dir / "model.bin").read_bytes()
    other = _run(tmp_path, q.model_copy(update={"train": configs.ClassifierTrain(seed=9)}), 1, corpus)["model"]
    assert (other.dir / "model.bin").read_bytes() != (a.dir / "model.bin").read_bytes()


def test_a_given_model_is_used_as_is(tmp_path, positives):
    trained = _run(tmp_path, QualityConfig(positives=positives))["model"]
    given = tmp_path / "mine.bin"
    given.write_bytes((trained.dir / "model.bin").read_bytes())
    built = _run(tmp_path, QualityConfig(model=str(given)))
    assert (built["model"].dir / "model.bin").read_bytes() == given.read_bytes()
    assert built["model"].stats["heldout"] == "not measured" and built["model"].stats["source"] == "given"
    assert built["quality"].stats["fates"]["dropped"] == 12


def test_too_few_positives_is_named_with_the_minimum(tmp_path):
    q = QualityConfig(positives=(_positives(tmp_path / "pos", 5),))
    cfg = stage_config(tmp_path / "store", quality=q)
    with pytest.raises(quality.QualityError, match=r"hold 5 usable documents; .*at least 20"):
        quality.preflight(cfg)


def test_a_model_file_that_is_not_fasttext_is_refused_on_load(tmp_path):
    bad = tmp_path / "model.bin"
    bad.write_bytes(b"PK\x03\x04 a zip, not a classifier")
    with pytest.raises(ConfigError, match=r"field 'quality': .*quality.model '.*' is not a fastText model"):
        configs.load(_with_quality(tmp_path, {"model": str(bad)}))


def test_a_label_set_the_stage_cannot_interpret_is_named(tmp_path):
    from moeflow.quality import classifier

    data = tmp_path / "t.txt"
    data.write_text("".join(f"__label__{'a' if i % 2 else 'b'} {'good' if i % 2 else 'bad'} text number {i}\n"
                            for i in range(200)))
    path = tmp_path / "ab.bin"
    # in a child process, as the stage trains: in this one fastText can read memory it never wrote (NaN)
    made = classifier.fit({"input": str(data), "thread": 1, "seed": 1, "verbose": 0}, path)
    assert made.returncode == 0, made.stderr
    cfg = stage_config(tmp_path / "store", quality=QualityConfig(model=str(path)))
    with pytest.raises(quality.QualityError, match=r"labels \['__label__\w', '__label__\w'\] include no __label__hq: "
                       r"set quality.label"):
        quality.preflight(cfg)
    wrong = stage_config(tmp_path / "store", quality=QualityConfig(model=str(path), label="good"))
    with pytest.raises(quality.QualityError, match=r"quality.label 'good' is not a label"):
        quality.preflight(wrong)
    quality.preflight(stage_config(tmp_path / "store", quality=QualityConfig(model=str(path), label="a")))


def test_a_rule_that_empties_a_domain_fails_naming_it(tmp_path, positives):
    q = QualityConfig(positives=positives, overrides={"forum": KeepRule(threshold=1.0)})
    with pytest.raises(quality.QualityError, match=r"every document of domain\(s\) \['forum'\].*quality.overrides"):
        _run(tmp_path, q)


def _with_quality(tmp_path: Path, section: dict) -> Path:
    import yaml

    data = yaml.safe_load(configs.resolve("smoke").read_text())
    data["quality"] = section
    path = tmp_path / "with-quality.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _planned(cfg: configs.RunConfig) -> list[str]:
    from moeflow.flows.pretrain import dag

    planned = []

    def plan(stage, **inputs):
        planned.append(stage.name)
        return "x"

    dag(plan, cfg)
    return planned


def test_quality_runs_after_dedup_only_when_configured(tmp_path, positives):
    cfg = configs.load("smoke").model_copy(update={"quality": None})
    assert _planned(cfg)[:5] == ["sources", "ingest", "filter", "dedup", "benchmarks"]
    with_q = cfg.model_copy(update={"quality": QualityConfig(positives=positives)})
    assert _planned(with_q)[:7] == ["sources", "ingest", "filter", "dedup", "quality_model", "quality", "benchmarks"]


def test_only_keep_changed_reuses_the_model_and_why_names_what_changed(tmp_path, positives):
    from moeflow.lineage import keys
    from moeflow.tasks.registry import STAGES
    from moeflow.tasks.runner import key_parts

    def parts(stage: str, q: QualityConfig) -> dict:
        return key_parts(STAGES[stage], stage_config(tmp_path, quality=q), {"docs": "d", "model": "m"})

    base = QualityConfig(positives=positives)
    stricter = base.model_copy(update={"keep": KeepRule(top_fraction=0.5)})
    assert parts("quality_model", stricter) == parts("quality_model", base)
    assert "config keep.top_fraction: null -> 0.5" in keys.explain(parts("quality", base), parts("quality", stricter))
    twice = base.model_copy(update={"synthetic_negatives": configs.SyntheticNegatives(per_document=2)})
    assert "config synthetic_negatives.per_document: 1.0 -> 2.0" in keys.explain(parts("quality_model", base),
                                                                              parts("quality_model", twice))
    before = parts("quality_model", base)
    (tmp_path / "pos" / "pos000.txt").write_text("edited")  # a positive's file: its size and xxh3
    assert any(r.startswith(f"fetched local:reference.{tmp_path / 'pos' / 'pos000.txt'}.xxh3:") for r in
               keys.explain(before, parts("quality_model", base)))
    model = tmp_path / "given.bin"
    built = _run(tmp_path, base)["model"]
    model.write_bytes((built.dir / "model.bin").read_bytes())
    before = parts("quality_model", QualityConfig(model=str(model)))
    model.write_bytes(model.read_bytes() + b"\0")
    assert any(r.startswith("fetched file:quality.model.xxh3:") for r in
               keys.explain(before, parts("quality_model", QualityConfig(model=str(model)))))


def test_why_names_a_changed_quality_field_by_its_path_and_reuses_the_model(tmp_path, positives):
    """`moeflow why`'s dry run against a store that holds both stages: a keep rule changed is named
    `quality.keep...` (as `filter.*` and `train.*` fields are named), and the model is reused."""
    from moeflow.flows.why import DryRun, Plan
    from moeflow.quality.stages import QUALITY, QUALITY_MODEL

    store = _fresh_store(tmp_path / "why")
    cfg = stage_config(store, quality=QualityConfig(positives=positives, keep=KeepRule(top_fraction=0.9)))
    docs = docs_artifact(store, _corpus(tmp_path / "corpus"))
    model = materialize("quality_model", cfg, {"docs": docs})
    materialize("quality", cfg, {"docs": docs, "model": model})
    stricter = cfg.model_copy(update={"quality": cfg.quality.model_copy(update={"keep": KeepRule(top_fraction=0.5)})})
    run = DryRun(stricter)
    planned = run(QUALITY_MODEL, docs=Plan("docs", "filter", "reuse", manifest=docs))
    assert planned.status == "reuse" and planned.manifest.path == model.path
    planned = run(QUALITY, docs=Plan("docs", "filter", "reuse", manifest=docs), model=planned)
    assert planned.status == "rebuild" and planned.reasons == ["config quality.keep.top_fraction: 0.9 -> 0.5"]


def test_degraders_are_seeded_change_the_text_and_unknown_kinds_are_named():
    from moeflow.quality.degrade import DEGRADERS, degrade

    rng = random.Random(2)
    texts = [_prose(rng) for _ in range(6)]
    kinds = tuple(DEGRADERS)
    made = degrade(texts, kinds, 2.0, texts, seed=4)
    assert made == degrade(texts, kinds, 2.0, texts, seed=4) != degrade(texts, kinds, 2.0, texts, seed=5)
    assert sorted({k for k, _ in made}) == sorted(kinds) and len(made) == 12
    assert all(text not in texts and text.split() for _, text in made)
    common = {"the", "a", "was", "in", "and", "that", "it", "had", "since", "about", "near", "long"}
    keywords = [t for k, t in made if k == "keywords"]
    assert sum(w.lower() in common for t in keywords for w in t.split()) < sum(
        w.lower() in common for t in texts for w in t.split()) / 3
    with pytest.raises(ValueError, match=r"unknown degrader\(s\) \['typo'\]; known: "):
        degrade(texts, ("typo",), 1.0, texts, seed=0)
    with pytest.raises(pydantic.ValidationError, match="synthetic_negatives"):
        QualityConfig(positives=(_positives_entry(),), synthetic_negatives={"kinds": ["typo"]})


def _positives_entry() -> configs.PositiveSource:
    return configs.PositiveSource(name="reference", path="/nowhere/*.txt")


def test_training_code_never_reaches_the_benchmarks_junk_generators():
    """The classifier learns junk as a class: nothing the stage trains with may come from benchmarks/quality.py."""
    import ast

    import moeflow.quality as package

    for path in Path(package.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any("benchmarks" in n for n in names), path
        assert "make_junk" not in path.read_text() and "FUNCTION_WORDS" not in path.read_text(), path


def test_report_and_chart_show_each_domains_line_and_the_documents_either_side(tmp_path, positives):
    from moeflow.card import plots, report

    q = QualityConfig(positives=positives, synthetic_negatives=DCLM, keep=KeepRule(top_fraction=0.6),
                      overrides={"news": KeepRule(threshold=0.5)})
    stats = _run(tmp_path, q)["quality"].stats
    rec = {"stage": "quality", "config": q.model_dump(mode="json"), "stats": stats}
    section = report._quality_table(rec)
    forum, news = stats["by_domain"]["forum"], stats["by_domain"]["news"]
    assert plots.quality_line(stats, rec["config"], "forum") == stats["cutoffs"]["all"][0]
    assert plots.quality_line(stats, rec["config"], "news") == 0.5
    for d, cut in ((forum, f"{stats['cutoffs']['all'][0]:g}"), (news, "0.5")):
        assert len(d["borderline"]["above"]) == 5 and len(d["borderline"]["below"]) == 5
        ids = "<br>".join(f"`{i}` {s:.6f}" for i, s in d["borderline"]["above"])
        assert f"| {cut} | {' '.join(map(str, d['histogram']))} | {ids} | " in section
        assert all(f"`{i}` {s:.6f}" in section for i, s in d["borderline"]["below"])
    png = tmp_path / plots.QUALITY
    plots.quality_histograms(stats, rec["config"], png)
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 5000


def test_the_filter_waterfall_gains_the_quality_step_per_source(tmp_path, positives):
    """The quality stage counts its drops per source as the filter does; the report's waterfall shows them
    per source after the filter's steps and dedup, as many as the ledger drops."""
    from collections import Counter

    from moeflow.card import plots, report

    corpus = _corpus(tmp_path / "corpus")
    q = QualityConfig(positives=positives, keep=KeepRule(threshold=0.5), synthetic_negatives=DCLM)
    built = _run(tmp_path, q, corpus=corpus)["quality"]
    source_of = {d["id"]: d["source"] for d in iter_docs(corpus)}
    dropped = Counter(source_of[r["doc_id"]] for r in read_ledger(built.dir).to_pylist() if r["fate"] == "dropped")
    read = Counter(source_of.values())
    assert sorted(dropped) == sorted(read) == ["forum-src", "news-src"]
    # the filter's record of a corpus that held, per source, 2 documents gopher dropped and 3 that dedup removed
    fil = {"stage": "filter", "config": {"steps": ["gopher_quality"]}, "stats": {"by_source": {
        s: {"kept": n + 3, "dropped:gopher_quality.gopher_short_doc": 2} for s, n in read.items()}}}
    header, _, *rows = report._waterfall_table(fil, {"stats": built.stats}).splitlines()
    assert header == "| source | read | gopher_quality | dedup | quality |"
    assert rows == [f"| {s} | {read[s] + 5} | {read[s] + 3} (-2) | {read[s]} (-3) | {read[s] - dropped[s]} "
                    f"(-{dropped[s]}) |" for s in sorted(read)]
    assert report._waterfall_table(fil, None).splitlines()[0] == "| source | read | gopher_quality |"
    png = tmp_path / plots.WATERFALL
    plots.filter_waterfall(plots.waterfall(fil["stats"], ["gopher_quality"], built.stats), png)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_lineage_report_tables_the_classifiers_heldout_metrics_and_where_its_positives_came_from(tmp_path, positives):
    """Trained from local positives: its measured metrics and the files its key records; a given model
    without positives: "not measured" and the given file by its bytes."""
    from moeflow.card import report
    from moeflow.card.graph import collect
    from moeflow.store.format import file_xxh3

    built = _run(tmp_path, QualityConfig(positives=positives))["model"]
    graph = collect([built.dir])
    said = report._classifier(graph[f"quality_model-{built.hash}"], graph)
    held = built.stats["heldout"]
    assert said["metrics"].splitlines()[2] == (
        f"| `quality_model-{built.hash}` | trained | `__label__hq` | {held['precision']} | {held['recall']} | "
        f"{held['roc_auc']} | {held['positives']} | {held['negatives']} |")
    files = sorted((tmp_path / "pos").glob("*.txt"))
    assert said["positives"].splitlines()[2] == (
        f"| `reference` | `{tmp_path / 'pos' / '*.txt'}` | {len(files)} files, {sum(f.stat().st_size for f in files):,}"
        " bytes (each file's path, size and xxh3 in the key) | read from this machine by `quality_model` |")
    given = tmp_path / "given.bin"
    given.write_bytes((built.dir / "model.bin").read_bytes())
    mine = _run(tmp_path, QualityConfig(model=str(given)))["model"]
    graph = collect([mine.dir])
    said = report._classifier(graph[f"quality_model-{mine.hash}"], graph)
    assert said["metrics"].splitlines()[2] == (
        f"| `quality_model-{mine.hash}` | given: `{given}` (xxh3 `{file_xxh3(given)}`) | `__label__hq` | "
        "not measured | not measured | not measured | - | - |")
    assert said["positives"] is None


def test_dataset_card_names_the_classifier_that_selected_the_corpus(tmp_path, positives):
    from moeflow.card import dataset
    from moeflow.card.graph import collect

    built = _run(tmp_path, QualityConfig(positives=positives, keep=KeepRule(threshold=0.5)))
    said = dataset._classifier(collect([built["quality"].dir]))
    held = built["model"].stats["heldout"]
    assert said["what"] == "a fastText classifier trained by `quality_model`" and said["positives"] == "`reference`"
    assert said["artifact"] == f"quality_model-{built['model'].hash}" and said["label"] == "__label__hq"
    assert said["heldout"].startswith(f"precision {held['precision']}, recall {held['recall']}, ROC AUC "
                                      f"{held['roc_auc']}")
    assert said["rule"] == '{"threshold": 0.5, "top_fraction": null}'
    rule = built["model"].stats["grammar"]
    assert said["grammar"] == (f"threshold {rule['threshold']}: zero, or the 0.005 quantile of {rule['documents']} "
                               "corpus documents where lower")
    by_domain = built["quality"].stats["by_domain"]
    assert said["kept"] == ", ".join(f"{d} {v['kept']} of {v['documents']}" for d, v in by_domain.items())
    assert dataset._classifier(collect([built["model"].dir])) is None  # no quality stage: nothing selected


def test_a_document_that_turns_into_another_is_dropped_as_incoherent(tmp_path, positives):
    """Two texts joined (at a sentence's end: no broken word to see) read as clean to a bag of n-grams, the
    classifier's whole view; the coherence rule drops them, their coherence below every whole document's."""
    rng, rows = random.Random(11), []
    for i in range(40):
        words, template = (WORDS, PROSE) if i % 2 else (OTHER, RAIL)
        rows.append((f"good{i:02d}", _prose(rng, 40, words, template)))
    for i in range(4):
        first, second = ((WORDS, PROSE), (OTHER, RAIL))[:: 1 if i % 2 else -1]
        rows.append((f"joined{i}", _prose(rng, 10 + 10 * i, *first) + " " + _prose(rng, 40 - 10 * i, *second)))
    random.Random(2).shuffle(rows)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    with DocWriter(corpus) as w:
        for doc_id, text in rows:
            w.write({"id": doc_id, "source": "web-src", "domain": "web", "path": "p", "text": text})
    q = QualityConfig(positives=positives, keep=KeepRule(threshold=0.0),
                      coherence=configs.Coherence(clean_loss=0.1, min_words=30))
    built = _run(tmp_path, q, corpus=corpus)
    threshold = built["model"].stats["coherence"]["threshold"]
    ledger = {r["doc_id"]: r for r in read_ledger(built["quality"].dir).to_pylist()}
    for i in range(4):
        r = ledger[f"joined{i}"]
        assert (r["fate"], r["reason"]) == ("dropped", "quality.incoherent"), r
        assert json.loads(r["detail"])["coherence"] < threshold == json.loads(r["detail"])["threshold"]
    dropped_whole = [d for d, r in ledger.items() if d.startswith("good") and r["fate"] == "dropped"]
    assert len(dropped_whole) <= 4, dropped_whole  # about clean_loss of the 40
    table = pq.read_table(built["quality"].dir / "scores.parquet").to_pylist()
    joined = [r["coherence"] for r in table if r["id"].startswith("joined")]
    assert max(joined) < min(r["coherence"] for r in table if r["id"].startswith("good"))


SMALL = set("the near was in a about and that it had since on this is by before may for its".split())


def _grammar_corpus(folder: Path, rng: random.Random) -> list[tuple[str, str]]:
    """(id, text): 120 clean documents in two domains, then one with its small words stripped and one with its
    words in random order planted in each (ids say which); written to `folder`, one source per domain."""
    rows = []
    for domain, words, template in (("news", WORDS, PROSE), ("rail", OTHER, RAIL)):
        rows += [(f"{domain}-good{i:02d}", _prose(rng, 20, words, template)) for i in range(60)]
        text = _prose(rng, 20, words, template).split()
        rows.append((f"{domain}-stripped", " ".join(w for w in text if w.lower() not in SMALL)))
        rows.append((f"{domain}-shuffled", " ".join(rng.sample(text, len(text)))))
    folder.mkdir()
    with DocWriter(folder) as w:
        for doc_id, text in rows:
            domain = doc_id.split("-")[0]
            w.write({"id": doc_id, "source": f"{domain}-src", "domain": domain, "path": "p", "text": text})
    return rows


def test_text_without_its_grammar_is_dropped_as_ungrammatical(tmp_path, positives):
    """Text with its small words stripped, or its words shuffled, keeps the vocabulary of clean text, so a bag of
    n-grams misses what it lost; the grammar rule, calibrated on the corpus sample, drops it with its value and
    the threshold, and about its `clean_loss` share of the clean documents at most."""
    _grammar_corpus(tmp_path / "corpus", random.Random(4))
    q = QualityConfig(positives=positives, keep=KeepRule(threshold=0.0), grammar=configs.Grammar(clean_loss=0.05),
                      coherence=configs.Coherence(clean_loss=0),
                      train=configs.ClassifierTrain(negatives_per_positive=5))  # the sample: the whole corpus
    built = _run(tmp_path, q, corpus=tmp_path / "corpus")
    rule = built["model"].stats["grammar"]
    assert rule["documents"] == 124 and rule["clean_loss"] == 0.05 and {"the", "on"} <= set(rule["words"])
    ledger = {r["doc_id"]: r for r in read_ledger(built["quality"].dir).to_pylist()}
    for doc_id in ("news-stripped", "news-shuffled", "rail-stripped", "rail-shuffled"):
        r = ledger[doc_id]
        assert (r["fate"], r["reason"]) == ("dropped", "quality.ungrammatical"), r
        detail = json.loads(r["detail"])
        assert detail["grammar"] < detail["threshold"] == rule["threshold"] and "score" in detail
    assert sum(r["fate"] == "dropped" for d, r in ledger.items() if "good" in d) <= 6  # 5% of 124
    table = {r["id"]: r["grammar"] for r in pq.read_table(built["quality"].dir / "scores.parquet").to_pylist()}
    assert max(v for d, v in table.items() if "good" not in d) < min(v for d, v in table.items() if "good" in d)


def test_grammar_learns_its_common_words_from_the_corpus_in_any_language(tmp_path):
    """No fixed word list: in a made-up language the sample's own most widespread words are the common words,
    its documents score above zero and the same documents in random order or stripped of them below; the
    threshold is zero, or the sample's `clean_loss` quantile where that is lower."""
    from moeflow.quality import grammar

    rng = random.Random(9)
    nouns = [f"zor{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    sample = [" ".join(f"ka {rng.choice(nouns)} mi lu {rng.choice(nouns)} po" for _ in range(30)).split()
              for _ in range(40)]
    calibrated = grammar.calibrate(sample, configs.Grammar(clean_loss=0.1, top=4))
    assert sorted(calibrated["words"]) == ["ka", "lu", "mi", "po"]
    model = grammar.Model(calibrated["words"], calibrated["counts"])
    values = sorted(model.value(ws) for ws in sample)
    assert calibrated["threshold"] == 0.0 < values[0]  # zero: no more grammar than chance
    assert all(model.value(rng.sample(ws, len(ws))) < 0 for ws in sample)
    stripped = [w for w in sample[0] if w.startswith("zor")]  # its small words gone: nothing for grammar to see
    grammar.write(tmp_path, calibrated)
    judge = grammar.Judge(tmp_path)  # as the quality stage reads it from the model's folder
    assert judge.value(stripped) == 0 and not judge.passes(judge.value(stripped)) and judge.passes(values[0])
    # a sample whose documents read below zero often lowers the threshold to its quantile
    mixed = sample + [rng.sample(ws, len(ws)) for ws in sample[:10]]
    lowered = grammar.calibrate(mixed, configs.Grammar(clean_loss=0.1, top=4))
    model = grammar.Model(lowered["words"], lowered["counts"])
    assert lowered["threshold"] == round(float(np.quantile([model.value(ws) for ws in mixed], 0.1)), 6) < 0


@pytest.fixture(scope="module")
def token_store(tmp_path_factory):
    """30 documents in domains a and b, tokenized: document i is i * 40 words longer than document 0."""
    from moeflow.configs import TokenizerConfig
    from moeflow.tokenize import store, tokenizer

    docs, tok_dir, store_dir = (tmp_path_factory.mktemp(n) for n in ("docs", "tok", "store"))
    rng = random.Random(0)
    with DocWriter(docs) as w:
        for i in range(30):
            text = " ".join(rng.choice(WORDS) for _ in range(400 + 40 * i))
            w.write({"id": f"doc{i:02d}", "source": "s", "domain": "a" if i % 3 else "b", "path": "p", "text": text})
    tokenizer.build(TokenizerConfig(kind="bpe", vocab_size=512), docs, tok_dir)
    store.run(TokenizerConfig(shard_tokens=100_000), docs, tok_dir, store_dir)
    return tok_dir, store_dir


def test_quality_buckets_repeat_each_domains_best_documents_by_their_factor(token_store, tmp_path):
    """Half of each domain scores >= 0.5 and is drawn 3 times as often per token as the other half; the
    domains keep their weights, the stats and the model card's mix table hold tokens per bucket, and a bucket
    needing more than max_epochs is named."""
    from moeflow.card.model_card import _mix
    from moeflow.configs import MixConfig, Phase
    from moeflow.tokenize import mix

    tok_dir, store_dir = token_store
    scores = {f"doc{i:02d}": round((i % 15) / 15 + 0.01, 6) for i in range(30)}  # 0.01 .. 0.94, twice
    buckets = ({"min_score": 0.5, "repeat": 3.0}, {"min_score": 0.0, "repeat": 1.0})
    cfg = MixConfig(weights={"a": 0.5, "b": 0.5}, heldout={"fraction": 0.1}, quality_buckets=buckets)
    phase = Phase(name="main", index=0, steps=500, start_step=0, seq_len=32, weights={"a": 0.5, "b": 0.5})
    stats = mix.run(cfg, seed=3, phases=[phase], batch_size=4, store_dir=store_dir, tokenizer_dir=tok_dir,
                    out=tmp_path, leakage=False, scores=scores)
    plan = stats["plan"]
    assert sorted(plan) == ["a@0", "a@0.5", "b@0", "b@0.5"]
    held = {d for ids in stats["heldout_doc_ids"].values() for d in ids}
    for domain in ("a", "b"):
        low, high = plan[f"{domain}@0"], plan[f"{domain}@0.5"]
        drawn = [b["tokens"] / b["training_tokens_available"] for b in (high, low)]  # passes over each
        assert 2.5 < drawn[0] / drawn[1] < 3.5, (domain, drawn)
        members = [d for d in scores if d not in held and (int(d[3:]) % 3 != 0) == (domain == "a")]
        assert high["documents"] == sum(scores[d] >= 0.5 for d in members)
    shares = stats["train_tokens_per_domain"]
    assert abs(shares["a"] / sum(shares.values()) - 0.5) < 0.02
    assert set(stats["phases"][0]["tokens_per_domain"]) == set(plan)
    assert "| a@0.5 |" in _mix(stats)["domains_table"] and "| a@0.5 |" in _mix(stats)["phases_table"]
    tight = cfg.model_copy(update={"max_epochs": 1.0})
    with pytest.raises(ConfigError, match=r"needs domain '[ab]@0\.5' repeated \d+ times .* mix\.max_epochs = 1"):
        mix.run(tight, seed=3, phases=[phase], batch_size=4, store_dir=store_dir, tokenizer_dir=tok_dir,
                out=tmp_path / "tight", leakage=False, scores=scores)


@pytest.mark.parametrize(("buckets", "error"), [
    ([{"min_score": 0.5, "repeat": 2}], r"mix\.quality_buckets.*no bucket starts at min_score 0"),
    ([{"min_score": 0, "repeat": 1}, {"min_score": 0, "repeat": 2}], r"mix\.quality_buckets.*share a min_score"),
    ([{"min_score": 0, "repeat": 0}], r"mix\.quality_buckets\.0\.repeat"),
    ([{"min_score": 1.5, "repeat": 1}], r"mix\.quality_buckets\.0\.min_score"),
])
def test_a_bad_quality_bucket_is_a_config_error_naming_the_field(tmp_path, buckets, error):
    with pytest.raises(ConfigError, match=error):
        configs.load("smoke", mix={"quality_buckets": buckets})


def test_quality_buckets_without_a_quality_section_is_a_config_error():
    with pytest.raises(ConfigError, match=r"mix\.quality_buckets splits domains by the quality stage's scores"):
        configs.load("smoke", quality=None, mix={"quality_buckets": [{"min_score": 0, "repeat": 1}]})


def test_the_mix_reads_the_quality_scores_only_with_buckets():
    """With mix.quality_buckets the mix stage is given the quality stage's artifact (its scores, and its key
    follows them); without, its inputs are as before, and rungs' and proxies' mixes draw domains whole."""
    from moeflow.flows.pretrain import dag
    from moeflow.tasks.registry import STAGES

    def mix_inputs(cfg: configs.RunConfig) -> dict:
        seen = {}

        def plan(stage, **inputs):
            seen[stage.name] = inputs
            return stage.name

        dag(plan, cfg)
        return seen["mix"]

    smoke = configs.load("smoke")
    assert mix_inputs(smoke) == {"shards": "tokenize", "tokenizer": "tokenizer"}
    bucketed = configs.load("smoke", mix={"quality_buckets": [{"min_score": 0, "repeat": 1},
                                                              {"min_score": 0.8, "repeat": 2}]})
    assert mix_inputs(bucketed) == {"shards": "tokenize", "tokenizer": "tokenizer", "quality": "quality"}
    assert [b.min_score for b in bucketed.mix.quality_buckets] == [0.0, 0.8]
    for own in ("rung_mix", "proxy_mix"):
        assert STAGES[own].config(bucketed)["mix"].quality_buckets == ()
