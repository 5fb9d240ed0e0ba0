"""The `quality` section: the learned quality classifier (`quality_model`) and the keep rule of `quality`.

Its own module so that the data stages' slices in `data.py` stay as they are: a run without `quality:` runs
the pipeline of old.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from moeflow.configs.base import Frozen, operational
from moeflow.configs.data import SourceConfig

FASTTEXT_MAGIC = (793712314).to_bytes(4, "little")  # the first four bytes of every fastText .bin / .ftz


class PositiveSource(SourceConfig):
    """A source of high-quality reference text (a registry package's files or your own), read only to train
    the classifier: it is not part of the training corpus unless `sources` lists it too."""

    domain: str = "positives"
    license: str = "unknown"


class KeepRule(Frozen):
    """Which scored documents stay: those scoring at least `threshold`, or the best `top_fraction` of them."""

    threshold: float | None = Field(default=None, ge=0, le=1)
    top_fraction: float | None = Field(default=None, gt=0, le=1)

    @model_validator(mode="after")
    def _one(self) -> KeepRule:
        if (self.threshold is None) == (self.top_fraction is None):
            raise ValueError("give keep either `threshold: X` (0..1) or `top_fraction: F` (0 < F <= 1)")
        return self


class ClassifierTrain(Frozen):
    """How `quality_model` trains fastText (the DCLM recipe: positives against a seeded sample of the corpus)."""

    seed: int = 0
    heldout_fraction: float = Field(default=0.2, gt=0, lt=0.5)  # of each class, kept out to measure the model
    negatives_per_positive: float = Field(default=1.0, gt=0)  # corpus documents sampled per positive
    epoch: int = Field(default=5, ge=1)
    lr: float = Field(default=0.1, gt=0)
    # fastText's own defaults (dim 100, 2M hash buckets) write an 800 MB model; its size is
    # 4 * dim * (words + bucket) bytes, so these give about 13 MB on a small corpus
    dim: int = Field(default=64, ge=1)
    word_ngrams: int = Field(default=2, ge=1)
    bucket: int = Field(default=50_000, ge=0)  # hash buckets of the word n-grams (0 with word_ngrams 1)
    min_count: int = Field(default=1, ge=1)
    max_chars: int = Field(default=20_000, gt=0)  # of each document, the text the classifier reads
    # models trained without a fold of the training corpus documents each, to score those documents unseen:
    # the clean-loss quantiles come from every sampled corpus document, not the held-out fifth alone (0 or 1:
    # from the held-out ones only; each fold is one more training)
    folds: int = Field(default=4, ge=0)


Degrader = Literal["unigram", "bigram", "window_shuffle", "token_drop", "repeat_span", "patchwork", "keywords"]


class SyntheticNegatives(Frozen):
    """Degraded versions of the training documents (`quality/degrade.py`), labelled low quality: they teach the
    classifier broken text as a class. With any, the corpus sample is trained as clean text next to the
    positives; with none (`kinds: []`), the corpus sample is the negatives (DCLM's recipe as published)."""

    # bigram, repeat_span and patchwork are opt-in: to a bag of 2-grams they read as clean, and lowered the
    # held-out ROC AUC on the tiny preset from 0.99 to 0.72 (README, "Quality classifier")
    kinds: tuple[Degrader, ...] = ("unigram", "window_shuffle", "token_drop", "keywords")
    per_document: float = Field(default=1.0, gt=0)  # degraded versions made per training document (1: balanced)


class Coherence(Frozen):
    """Documents that read as two texts joined (`quality/coherence.py`): dropped when the lowest tf-idf cosine
    between the words before and after any cut, over its value were the words in random order, falls below
    the `clean_loss` quantile of the corpus sample's own."""

    # the share of clean documents (the corpus sample) the rule may drop; 0 turns it off. On the quality
    # benchmark 0.01 caught about 80% of spliced documents, which the classifier alone misses
    clean_loss: float = Field(default=0.01, ge=0, lt=0.5)
    min_words: int = Field(default=100, ge=10)  # words (not in every sample document) each side of a cut holds
    # corpus documents sampled to calibrate on when no positives are declared (else the classifier's sample)
    sample: int = Field(default=200, ge=20)


class Grammar(Frozen):
    """Documents whose small words are not where running text puts them (`quality/grammar.py`): dropped when
    the per-token log-likelihood ratio of what follows the corpus sample's `top` words by document frequency
    (the sample's transitions over the document's own word frequencies) is below zero (no more grammar than
    chance), or below the `clean_loss` quantile of the sample's own values where that is lower."""

    # at most the share of clean documents (the corpus sample) the rule may drop; 0 turns it off
    clean_loss: float = Field(default=0.005, ge=0, lt=0.5)
    top: int = Field(default=50, ge=1)  # the sample's most widespread words: its language's function words


class QualityConfig(Frozen):
    # high-quality reference text to train on; with `model`, used only to measure the given model
    positives: tuple[PositiveSource, ...] = ()
    # your own fastText classifier (.bin or .ftz): used as is, its bytes in the key
    model: str | None = None
    # the label meaning high quality: `__label__hq` for a trained model; for `model`, one of its labels
    # (unset: `__label__hq` when the model has it)
    label: str | None = None
    train: ClassifierTrain = ClassifierTrain()
    synthetic_negatives: SyntheticNegatives = SyntheticNegatives()
    coherence: Coherence = Coherence()
    grammar: Grammar = Grammar()
    keep: KeepRule = KeepRule(threshold=0.5)
    overrides: dict[str, KeepRule] = {}  # per domain or source name (a source's rule wins over its domain's)
    # record shards the stage is split into (unset: `execution.shards`); the output is the same for any
    shards: int | None = operational(None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> QualityConfig:
        if not self.positives and self.model is None:
            raise ValueError("give quality.positives (sources of high-quality text to train a classifier on) "
                             "or quality.model (a fastText .bin), or remove the quality section")
        names = [p.name for p in self.positives]
        if len(set(names)) != len(names):
            raise ValueError(f"quality.positives: names must be unique, got {names}")
        if self.model is not None:
            check_model_file(self.model)
        return self

    def rule(self, domain: str, source: str) -> KeepRule:
        """The keep rule of a document of `domain` from `source`."""
        return self.overrides.get(source) or self.overrides.get(domain) or self.keep

    def group(self, domain: str, source: str) -> str:
        """The group a `top_fraction` rule ranks a document in: its source's, its domain's or the whole corpus."""
        return f"source:{source}" if source in self.overrides else f"domain:{domain}" \
            if domain in self.overrides else "all"


def check_model_file(path: str) -> None:
    """`quality.model` must be a fastText model file: its first bytes say so."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"quality.model {path!r} is not a file; point it at a fastText classifier (.bin)")
    with p.open("rb") as f:
        head = f.read(4)
    if head != FASTTEXT_MAGIC:
        raise ValueError(f"quality.model {path!r} is not a fastText model (its first bytes are {head!r}, not "
                         "fastText's magic number): give a .bin written by fastText's save_model")
