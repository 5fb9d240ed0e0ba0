"""Quality classifier benchmark: junk with known labels planted among held-out real documents that today's
heuristic filters keep, judged by the heuristics alone, the classifier alone, and both.

Run: `python benchmarks/quality.py [--config tiny] [--per-domain N] [--seed S]` after `moeflow fetch tiny`.

Clean documents are the preset's corpora (up to `--per-domain` a domain, read by ingest's readers) that its
filter config keeps, the Python tutorial, HOWTOs and FAQ left out: those are the classifier's positives. The
classifier is trained by `quality_model`'s own code (`classifier.build`) with the preset's quality section
(its training and synthetic negatives; a preset without one gets the defaults), the clean documents'
training half as its corpus sample. The generators below never reach training: the synthetic negatives come
from `moeflow.quality.degrade`, written apart from them. From the other half's documents it makes junk of
five kinds: `shuffled` (a document's words in random order), `spam` (keywords and boilerplate repeated),
`spliced` (two documents cut mid-sentence and joined), `templated` (a near-empty page of a template),
`no_function_words` (a document with its function words removed). `--clean-loss` (0.02) is the share of
clean documents the quality stage is let drop: the coherence rule takes its own (`quality.coherence.clean_loss`,
0.01 by default), the grammar rule its at most (`quality.grammar.clean_loss`, 0.005), and the classifier's
threshold is the quantile of what is left (0.005) of the scores of the corpus documents no model scoring
them saw (`quality_model`'s held-out ones, and each training one scored by a model trained without its
fold; no junk seen).
The coherence and grammar rules (`quality/coherence.py`, `quality/grammar.py`) are calibrated, as
`quality_model` does, on the same corpus sample, never on junk; neither reads a word list of this file.
Reported: per judge (heuristics; `score_only`, the classifier's score; `quality.incoherent` and
`quality.ungrammatical`, what each rule drops, in the stage's order; `classifier`, the quality stage: score
and rules; `both`), the recall of planted junk and the fraction
of clean documents dropped; `junk_recall` is the quality stage's recall (with the heuristics) on the junk the
heuristics alone keep, and `junk_recall_per_kind` the same per kind; `mb_per_s_core` is scoring throughput
on one process (best of 3): the bytes of the whole documents over the time to score them (the classifier
reads each one's first `max_chars` characters, the rules all of it);
`heldout_auc` the classifier's held-out ROC AUC on its own construction (held-out clean documents against
degraded versions of them). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import numpy as np
from datatrove.data import Document

from moeflow import configs, filters
from moeflow.configs import PositiveSource, QualityConfig
from moeflow.ingest import resolve_source
from moeflow.ingest.reader import records
from moeflow.quality import classifier as qc
from moeflow.quality.score import Rules

FUNCTION_WORDS = set("the a an of to in and or but is are was were be been for on at by with from as that this "
                     "it its which who whom whose not no if then than so such".split())
SPAM = ("buy now", "best price", "click here", "free shipping", "limited offer", "subscribe today", "casino",
        "cheap", "discount", "win big", "100% guaranteed", "order online")
TEMPLATE = ("Home | About | Contact | Login\n\n{title}\n\nThis page has no content yet.\n\nPosted by admin on "
            "{date}. 0 comments.\n\nCategories: Uncategorized\n\nCopyright 2024. All rights reserved.")
DOCS = "usr/share/doc/python3.11/html/_sources"


BUILT: dict[tuple[str, ...], list] = {}
RULES = ("quality.incoherent", "quality.ungrammatical")


def heuristics_keep(cfg: configs.RunConfig, text: str, *keys: str) -> bool:
    """Whether today's filters (the preset's, with the overrides of `keys`: domain, source) keep `text`."""
    if keys not in BUILT:
        BUILT[keys] = filters.build(cfg.filter.resolved(*keys))
    return filters.judge(BUILT[keys], Document(text=text, id="x"))[0]


def clean_documents(cfg: configs.RunConfig, per_domain: int, seed: int) -> list[tuple[str, str]]:
    """(domain, text) of up to `per_domain` documents a domain that the preset's filters keep."""
    rng, by_domain = random.Random(seed), {}
    for src in cfg.sources:
        rs = resolve_source(src)
        if rs is not None:
            docs = [(d, t) for d, _, t, q in records(rs) if q is None and not any(
                f"/{part}/" in d for part in ("tutorial", "howto", "faq"))]
            by_domain.setdefault(src.domain, []).extend((src.name, src.domain, d, t) for d, t in docs)
    out = []
    for domain, docs in sorted(by_domain.items()):
        rng.shuffle(docs)
        kept = 0
        for name, dom, _, text in docs:
            if kept == per_domain:
                break
            if heuristics_keep(cfg, text, dom, name):
                out.append((domain, text))
                kept += 1
    return out


def make_junk(clean: list[str], rng: random.Random) -> list[tuple[str, str]]:
    """(kind, text): one of each kind per clean document given."""
    out = []
    for i, text in enumerate(clean):
        words = text.split()
        shuffled = words[:]
        rng.shuffle(shuffled)
        out.append(("shuffled", " ".join(shuffled)))
        out.append(("spam", " ".join(rng.choice(SPAM) for _ in range(max(60, len(words) // 4)))))
        other = clean[(i + 1) % len(clean)]
        out.append(("spliced", text[: len(text) // 2] + other[len(other) // 2:]))
        out.append(("templated", TEMPLATE.format(title=" ".join(words[:6]), date=f"2024-0{1 + i % 9}-1{i % 10}")))
        out.append(("no_function_words", " ".join(w for w in words if w.lower() not in FUNCTION_WORDS)))
    return out


def quality_config(cfg: configs.RunConfig, seed: int) -> QualityConfig:
    """The preset's quality section (its positives, training and synthetic negatives) with the seed given; a
    preset without one gets the defaults with the Python tutorial, HOWTOs and FAQ as positives."""
    positives = tuple(PositiveSource(name=p, package="python3.11-doc", path=f"{DOCS}/{p}/*.rst.txt")
                      for p in ("tutorial", "howto", "faq"))
    q = cfg.quality or QualityConfig(positives=positives)
    return q.model_copy(update={"train": q.train.model_copy(update={"seed": seed})})


def train(q: QualityConfig, corpus: list[str], folder: Path):
    """The classifier, trained as `quality_model` trains (`classifier.build`), `corpus` as the corpus sample,
    and its coherence and grammar rules calibrated on the same sample; and its held-out metrics."""
    s = qc.slice_of(q)
    stats = qc.build(s, qc.read_positives(q.positives), corpus, folder) | qc.calibrate_rules(s, corpus, folder)
    return qc.load(str(folder / qc.MODEL)), Rules(folder), stats


def score(model, rules: Rules, label: str, texts: list[str], chars: int) -> tuple[np.ndarray, list]:
    """What the `quality` stage's score phase computes: the classifier's score of each text's first `chars`
    characters, and the rule each whole text fails (`quality.incoherent`, `quality.ungrammatical`) or None."""
    values = [dict(zip(("coherence", "grammar"), rules.values(t), strict=True)) for t in texts]
    return qc.scores(model, label, [qc.line(t, chars) for t in texts]), [rules.failed(v) for v in values]


def judged(cfg: configs.RunConfig, texts: list[tuple[str, str]], scores: np.ndarray, threshold: float,
           failed: list) -> dict:
    """Per judge (heuristics, the classifier's score alone, each rule alone, the quality stage: score and
    rules, and the heuristics with the quality stage), which of `texts` ((domain, text)) it drops."""
    heur = np.array([not heuristics_keep(cfg, t, d) for d, t in texts])
    cls = scores < threshold
    ruled = {r: np.array([f is not None and f[0] == r for f in failed]) for r in RULES}
    stage = cls | ruled[RULES[0]] | ruled[RULES[1]]
    return {"heuristics": heur, "score_only": cls, **ruled, "classifier": stage, "both": heur | stage}


def classifier_threshold(stats: dict, share: float) -> float:
    """The score below which `share` of the held-out corpus documents fall (one of those `quality_model` measures)."""
    quantiles = stats["heldout"]["corpus_quantiles"]
    key = f"{round(share, 4):g}"
    if key not in quantiles:
        raise SystemExit(f"--clean-loss less quality.coherence.clean_loss is {share:g}; it must be one of "
                         f"{sorted(quantiles)} (the quantiles quality_model measures)")
    return quantiles[key]


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--per-domain", type=int, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clean-loss", type=float, default=0.02,
                    help="the share of clean documents the quality stage may drop: the coherence rule's, and "
                         "the classifier's threshold at the quantile of the held-out corpus scores left")
    args = ap.parse_args()
    cfg, rng = configs.load(args.config), random.Random(args.seed)
    clean = clean_documents(cfg, args.per_domain, args.seed)
    rng.shuffle(clean)
    half = len(clean) // 2
    fit, test = clean[:half], clean[half:]
    with tempfile.TemporaryDirectory() as tmp:
        q = quality_config(cfg, args.seed)
        model, rules, stats = train(q, [t for _, t in fit], Path(tmp))
        rules_loss = q.coherence.clean_loss + q.grammar.clean_loss
        held, threshold = stats["heldout"], classifier_threshold(stats, args.clean_loss - rules_loss)
        chars = q.train.max_chars
        junk = [(d, k, j) for (d, t) in test for k, j in make_junk([t, rng.choice(test)[1]], rng)[:5]]
        texts = [t for _, t in test] + [j for _, _, j in junk]
        seconds = []
        for _ in range(3):  # best of 3: the machine is shared
            t0 = time.perf_counter()
            scores, failed = score(model, rules, stats["label"], texts, chars)
            seconds.append(time.perf_counter() - t0)
    mb = sum(len(x.encode()) for x in texts) / 1e6
    drops = judged(cfg, [(d, t) for d, t in test] + [(d, j) for d, _, j in junk], scores, threshold, failed)
    n = len(test)
    report = {}
    for judge, dropped in drops.items():
        report[judge] = {"clean_dropped_fraction": round(float(dropped[:n].mean()), 4),
                         "junk_recall": round(float(dropped[n:].mean()), 4),
                         "per_kind": {k: round(float(np.mean([dropped[n + i] for i, (_, kk, _) in enumerate(junk)
                                                              if kk == k])), 4)
                                      for k in sorted({k for _, k, _ in junk})}}
    missed = ~drops["heuristics"][n:]
    caught = drops["both"][n:]
    kept_kinds = {k for (_, k, _), m in zip(junk, missed, strict=True) if m}
    per_kind = {k: round(float(np.mean([c for (_, kk, _), c, m in zip(junk, caught, missed, strict=True)
                                        if kk == k and m])), 4) for k in sorted(kept_kinds)}
    out = {"clean_documents": n, "junk_documents": len(junk), "threshold": round(threshold, 6),
           "judges": report, "junk_recall": round(float(caught[missed].mean()), 4), "junk_recall_per_kind": per_kind,
           "clean_dropped_fraction": report["both"]["clean_dropped_fraction"],
           "mb_per_s_core": round(mb / min(seconds), 2), "heldout_auc": held["roc_auc"], "heldout": held,
           "coherence": stats["coherence"], "grammar": {k: v for k, v in stats["grammar"].items() if k != "words"}}
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
