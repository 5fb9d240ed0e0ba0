"""The `quality_model` stage: a fastText quality classifier, trained or given, and how well it separates.

Trained, it reads `quality.positives` and a seeded sample of the deduplicated corpus, and holds out a seeded
share of each. With `quality.synthetic_negatives` (the default) both are clean text (`__label__hq`) against
degraded versions of them (`__label__cc`, `degrade.py`): the classifier learns broken text as a class, in every
domain. Without, it follows DCLM's recipe: positives (`__label__hq`) against the corpus sample (`__label__cc`).
fastText trains on one thread with the seed, so the model's bytes are the same for a seed. Given
(`quality.model`), the file is used as is. Either way the artifact holds `model.bin` and, when positives are
declared, the model's held-out precision, recall and ROC AUC on the same construction, and the quantiles of
the scores of corpus documents the scoring model never saw (the threshold that drops 0.5%, 1%, 2%, 5%, 10% of
clean text: the held-out ones, and each training one scored by a model trained without its fold, or for a
given model the whole sample) (else "not measured").
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from moeflow.configs import PositiveSource, RunConfig
from moeflow.core.documents import count_docs, iter_docs
from moeflow.ingest import resolve_sources_list
from moeflow.ingest.reader import records
from moeflow.ingest.sources_stage import identities
from moeflow.quality import coherence, grammar
from moeflow.quality.degrade import degrade
from moeflow.sources import fetch
from moeflow.sources.stage import file_identity

HQ, CC = "__label__hq", "__label__cc"
MIN_POSITIVES = 20  # a fifth held out leaves 4 to measure on and 16 to learn from: below that, no model
MODEL = "model.bin"
QUANTILES = (0.005, 0.01, 0.02, 0.05, 0.1)  # of held-out corpus documents' scores: thresholds and the share below each


class QualityError(ValueError):
    """The quality section cannot work as configured; the message names the field and the fix."""


def line(text: str, max_chars: int) -> str:
    """What the classifier reads of a document: its first `max_chars` characters on one line."""
    return " ".join(text[:max_chars].split())


@functools.cache
def load(path: str):
    import fasttext  # its C++ extension loads only in the processes that score or train

    return fasttext.load_model(path)


def hq_label(model, label: str | None) -> str:
    """The label of `model` that marks high quality (`quality.label`, or `__label__hq` when it has it)."""
    labels = list(model.labels)
    if len(labels) < 2:
        raise QualityError(f"quality.model has one label {labels}: a quality classifier needs two or more "
                           "(high quality and the rest); give a supervised fastText classifier")
    if label is None:
        if HQ in labels:
            return HQ
        raise QualityError(f"quality.model's labels {labels} include no {HQ}: set quality.label to the one "
                           "that marks high-quality text")
    for name in (label, f"__label__{label}"):
        if name in labels:
            return name
    raise QualityError(f"quality.label {label!r} is not a label of quality.model (its labels: {labels}): set "
                       "quality.label to one of them")


def scores(model, label: str, lines: list[str]) -> np.ndarray:
    """P(`label`) for each line, rounded to 6 places (what the ledger shows and the keep rule compares)."""
    if not lines:
        return np.empty(0)
    labels, probs = model.predict(lines, k=-1)
    out = [dict(zip(ls, ps, strict=True)).get(label, 0.0) for ls, ps in zip(labels, probs, strict=True)]
    return np.round(np.clip(np.asarray(out, dtype=np.float64), 0.0, 1.0), 6)


def read_positives(positives: tuple[PositiveSource, ...]) -> list[str]:
    """The texts of the positives' documents (quarantined and empty ones left out); fails below the minimum."""
    texts = [text for rs in resolve_sources_list(positives) for _, _, text, q in records(rs)
             if q is None and text.strip()]
    if len(texts) < MIN_POSITIVES:
        names = ", ".join(p.name for p in positives)
        raise QualityError(
            f"quality.positives ({names}) hold {len(texts)} usable documents; training the classifier needs at "
            f"least {MIN_POSITIVES} (a fifth is held out to measure it): add sources or widen their `path`")
    return texts


def sample_corpus(docs_dir: Path, n: int, seed: int) -> list[str]:
    """A seeded sample of `n` documents of the corpus (all of them when it holds fewer), in stored order."""
    total = count_docs(docs_dir)
    chosen = set(np.random.default_rng(seed).choice(total, size=min(n, total), replace=False).tolist())
    return [row["text"] for i, row in enumerate(iter_docs(docs_dir, columns=["text"])) if i in chosen]


def split(texts: list[str], fraction: float, rng: np.random.Generator) -> tuple[list[str], list[str]]:
    """(train, held out): a seeded `fraction` of `texts`, at least one, held out."""
    order = rng.permutation(len(texts))
    cut = max(1, math.ceil(fraction * len(texts)))
    return [texts[i] for i in order[cut:]], [texts[i] for i in order[:cut]]


def roc_auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """The probability that a positive outscores a negative (ties count half): Mann-Whitney's U over |P||N|."""
    both = np.concatenate([pos, neg])
    order = both.argsort(kind="stable")
    ranks = np.empty(len(both))
    ranks[order] = np.arange(1, len(both) + 1)
    for value in np.unique(both):  # ties share their mean rank
        same = both == value
        ranks[same] = ranks[same].mean()
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def measure(model, label: str, pos: list[str], neg: list[str], max_chars: int) -> dict:
    """Held-out precision and recall at 0.5, and ROC AUC, of `model` on positives `pos` and negatives `neg`."""
    p = scores(model, label, [line(t, max_chars) for t in pos])
    n = scores(model, label, [line(t, max_chars) for t in neg])
    tp, fp = int((p >= 0.5).sum()), int((n >= 0.5).sum())
    return {"positives": len(p), "negatives": len(n), "precision": round(tp / (tp + fp), 4) if tp + fp else 0.0,
            "recall": round(tp / len(p), 4), "roc_auc": round(roc_auc(p, n), 4), "at": 0.5}


# fastText is trained in a child process of its own: its training reads heap memory it never wrote (seen:
# a second training in one process gives other bytes, and a third "Encountered NaN"; MALLOC_PERTURB_
# changes the model). A fresh process with allocations of 64 KiB and up mapped fresh (zeroed) gives the
# same bytes every time; tests/test_quality.py checks it.
FIT = ("import json, sys, fasttext\n"
       "a = json.loads(sys.argv[1])\n"
       "fasttext.train_supervised(**a['args']).save_model(a['out'])\n")


def fit(args: dict, model: Path) -> subprocess.CompletedProcess:
    """`fasttext.train_supervised(**args)` saved to `model`, in a child process of its own (see FIT)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | {"MALLOC_MMAP_THRESHOLD_": "65536"}
    return subprocess.run([sys.executable, "-c", FIT, json.dumps({"args": args, "out": str(model)})],
                          env=env, capture_output=True, text=True)


def train(texts: list[tuple[str, str]], cfg, out: Path) -> None:
    """Train fastText on (label, text) pairs with one thread and the seed: the same bytes for a seed."""
    t = cfg["train"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.txt"
        path.write_text("".join(f"{label} {line(text, t.max_chars)}\n" for label, text in texts))
        args = {"input": str(path), "epoch": t.epoch, "lr": t.lr, "dim": t.dim, "wordNgrams": t.word_ngrams,
                "minCount": t.min_count, "bucket": t.bucket, "seed": t.seed, "thread": 1, "verbose": 0}
        done = fit(args, out / MODEL)
    if done.returncode:
        raise QualityError(f"fastText failed to train the quality classifier: {done.stderr.strip()[-500:]}; "
                           "try a lower quality.train.lr")


def construction(pos: list[str], corpus: list[str], s: dict, seed: int) -> tuple[list[str], list[str]]:
    """(clean, junk) texts of one side of the split. With `synthetic_negatives`, the clean side is the positives
    and the corpus sample, the junk their degraded versions (word statistics from this side's corpus sample
    only, so held-out junk is made of held-out text); without, DCLM's: positives against the corpus sample."""
    syn, max_chars = s["synthetic_negatives"], s["train"].max_chars
    if not syn.kinds:
        return pos, corpus
    clean = [line(x, max_chars) for x in pos + corpus]
    junk = degrade(clean, syn.kinds, syn.per_document, [line(x, max_chars) for x in corpus], seed)
    return clean, [text for _, text in junk]


def out_of_fold(s: dict, pos_train: list[str], cor_train: list[str]) -> np.ndarray:
    """Scores of the training corpus documents, each by a model trained as the classifier is but without its
    fold (`train.folds` of them; none: no scores): clean text the scoring model never saw, more of it than the
    held-out split, so the low quantiles that set a clean-loss threshold come from more than a few documents."""
    t, out = s["train"], []
    folds = min(t.folds, len(cor_train))
    for f in range(folds if folds > 1 else 0):
        rest = [x for i, x in enumerate(cor_train) if i % folds != f]
        clean, junk = construction(pos_train, rest, s, t.seed + 2 + f)
        pairs = [(HQ, x) for x in clean] + [(CC, x) for x in junk]
        with tempfile.TemporaryDirectory() as tmp:
            train([pairs[i] for i in np.random.default_rng(t.seed + 2 + f).permutation(len(pairs))], s, Path(tmp))
            model = load(str(Path(tmp) / MODEL))
            out.extend(scores(model, hq_label(model, s["label"]), [line(x, t.max_chars) for x in cor_train[f::folds]]))
            load.cache_clear()
    return np.asarray(out, dtype=np.float64)


def build(s: dict, pos: list[str], corpus: list[str], out: Path) -> dict:
    """Split, train and measure: the classifier of `pos` (positives' texts) and `corpus` (the corpus sample)
    into `out`, and its held-out metrics (with the held-out corpus documents' score quantiles)."""
    t = s["train"]
    rng = np.random.default_rng(t.seed)
    (pos_train, pos_held), (cor_train, cor_held) = split(pos, t.heldout_fraction, rng), \
        split(corpus, t.heldout_fraction, rng)
    clean, junk = construction(pos_train, cor_train, s, t.seed)
    pairs = [(HQ, x) for x in clean] + [(CC, x) for x in junk]
    if not s["model"]:
        train([pairs[i] for i in rng.permutation(len(pairs))], s, out)
    model = load(str(out / MODEL))
    label = hq_label(model, s["label"])
    held_clean, held_junk = construction(pos_held, cor_held, s, t.seed + 1)
    heldout = measure(model, label, held_clean, held_junk, t.max_chars)
    unseen = corpus if s["model"] else cor_held  # a given model trained on none of the sample
    corpus_scores = np.concatenate([scores(model, label, [line(x, t.max_chars) for x in unseen]),
                                    [] if s["model"] else out_of_fold(s, pos_train, cor_train)])
    heldout["corpus_quantiles"] = {str(q): round(float(np.quantile(corpus_scores, q)), 6) for q in QUANTILES}
    heldout["corpus_scored"] = len(corpus_scores)
    load.cache_clear()  # the staging folder is renamed when it commits
    return {"label": label, "labels": list(model.labels), "heldout": heldout,
            "positives": {"documents": len(pos), "train": len(pos_train), "heldout": len(pos_held)},
            "corpus": {"documents": len(corpus), "train": len(cor_train), "heldout": len(cor_held)},
            "synthetic_negatives": {"train": len(junk), "heldout": len(held_junk)}}


def stage(s: dict, inputs: dict, out: Path) -> dict:
    """The `quality_model` body: train (or copy the given model), then measure it on the held-out split."""
    t = s["train"]
    stats: dict = {"source": "given" if s["model"] else "trained", "heldout": "not measured"}
    if s["model"]:
        shutil.copyfile(Path(s["model"]).expanduser(), out / MODEL)
    if s["positives"]:
        pos = read_positives(s["positives"])
        corpus = sample_corpus(inputs["docs"].dir, math.ceil(len(pos) * t.negatives_per_positive), t.seed)
        stats |= build(s, pos, corpus, out)
        stats["positives"]["sources"] = [p.name for p in s["positives"]]
    else:
        model = load(str(out / MODEL))
        stats.update(label=hq_label(model, s["label"]), labels=list(model.labels))
        load.cache_clear()
        corpus = sample_corpus(inputs["docs"].dir, s["coherence"].sample, t.seed)
    stats |= calibrate_rules(s, corpus, out)
    (out / "metrics.json").write_text(json.dumps(stats, indent=1, sort_keys=True))
    return stats


def calibrate_rules(s: dict, corpus: list[str], out: Path) -> dict:
    """The coherence and grammar rules calibrated on the corpus sample `corpus` into `out`; their figures for
    the metrics."""
    tokens = [coherence.words(t) for t in corpus]
    return {"coherence": coherence.write(out, coherence.calibrate(tokens, s["coherence"])),
            "grammar": grammar.write(out, grammar.calibrate(tokens, s["grammar"]))}


def config(c: RunConfig) -> dict:
    """`quality_model`'s slice: what shapes the model (the keep rule does not: changing it reuses the model)."""
    return slice_of(c.quality)


def slice_of(q) -> dict:
    """What of a quality section shapes the model."""
    return {"positives": q.positives, "model": q.model, "label": q.label, "train": q.train,
            "synthetic_negatives": q.synthetic_negatives, "coherence": q.coherence, "grammar": q.grammar}


def fetched(s: dict) -> dict:
    """The positives' packages and files, and the given model file by its bytes."""
    out = identities([p.package for p in s["positives"] if p.package], tuple(s["positives"]))
    return out | ({"file:quality.model": file_identity(s["model"])} if s["model"] else {})


def preflight(cfg: RunConfig) -> None:
    """Before any work: the given model's labels, and the positives already on this machine (a package not
    fetched yet is counted when the stage runs: `sources` fetches it)."""
    q = cfg.quality
    if q is None:
        return
    if q.model is not None:
        try:
            hq_label(load(str(Path(q.model).expanduser())), q.label)
        except ValueError as e:
            if isinstance(e, QualityError):
                raise
            raise QualityError(f"quality.model {q.model!r}: fastText cannot read it ({e}); give a .bin written "
                               "by fastText's save_model") from None
    if q.positives and all(fetch.read_receipt(p.package) for p in q.positives if p.package):
        read_positives(q.positives)
