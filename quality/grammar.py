"""Grammar: whether a document's small words sit where running text puts them, the signal a bag of n-grams
weighs too little in text whose content words are clean but whose grammar is gone (its function words
stripped, its words reordered, a keyword list, a page of tags).

The common words are the corpus sample's `top` words by document frequency: in any language, the words in
nearly every text are its articles, prepositions, pronouns and auxiliaries (no fixed list: the corpus says
which). Each token is one of them or "other"; the sample gives how often each common word is followed by
each class (add-one smoothed). A document's value is, per token, the log-likelihood ratio of what follows its
common words under the sample's transitions over the document's own class frequencies:
sum over positions i after a common word of log P_sample(c[i+1] | c[i]) - log P_doc(c[i+1]), over its
tokens. Running text scores above zero (its function words predict what follows them); reordered words score
near or below zero, whatever their frequencies; text short of common words has few terms to add up, so it
scores near zero too. The threshold is zero, the value of text whose common words tell no more about what
follows them than chance, lowered to the `clean_loss` quantile of the corpus sample's own values where that
is below zero (a corpus whose clean text reads so, code or tables, loses at most about that share of it).
One pass over the document's tokens (those coherence reads too).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

GRAMMAR = "grammar.json"


def top_words(tokens: Sequence[list[str]], top: int) -> list[str]:
    """The `top` words in the most documents of `tokens` (ties by the word)."""
    df = Counter(w for ws in tokens for w in set(ws))
    return [w for w, _ in sorted(df.items(), key=lambda kv: (-kv[1], kv[0]))[:top]]


def classes(tokens: list[str], ids: dict[str, int]) -> np.ndarray:
    """Each token's class: its index among the common words `ids`, or `len(ids)` for any other word."""
    return np.fromiter((ids.get(w, len(ids)) for w in tokens), dtype=np.int64, count=len(tokens))


class Model:
    """The common words and the log-probabilities of the class (a common word or "other", the last) following
    each class."""

    def __init__(self, common: list[str], counts: list[list[int]]):
        self.common, self.counts = common, counts
        self.ids = {w: i for i, w in enumerate(common)}
        m = np.asarray(counts, dtype=np.float64) + 1.0
        self.log_p = np.log(m / m.sum(axis=1, keepdims=True))

    @classmethod
    def of(cls, tokens: Sequence[list[str]], top: int) -> Model:
        common = top_words(tokens, top)
        ids = {w: i for i, w in enumerate(common)}
        counts = np.zeros((len(common) + 1, len(common) + 1), dtype=np.int64)
        for ws in tokens:
            c = classes(ws, ids)
            np.add.at(counts, (c[:-1], c[1:]), 1)
        return cls(common, counts.tolist())

    def value(self, tokens: list[str]) -> float:
        """The per-token log-likelihood ratio (6 decimals) of what follows the document's common words."""
        c = classes(tokens, self.ids)
        if len(c) < 2:
            return 0.0
        a, b = c[:-1], c[1:]
        after = a < len(self.common)
        own = np.log((np.bincount(c, minlength=len(self.common) + 1) + 1.0) / (len(c) + len(self.common) + 1))
        return round(float((self.log_p[a[after], b[after]] - own[b[after]]).sum() / len(c)), 6)


def calibrate(tokens: Sequence[list[str]], cfg) -> dict:
    """From a corpus sample (each document's tokens): the common words, their transition counts and the
    threshold: zero (no more grammar than chance), or the `cfg.clean_loss` quantile of the sample's values where
    that is lower (None with `clean_loss` 0: the rule is off)."""
    model = Model.of(tokens, cfg.top)
    values = np.array([model.value(ws) for ws in tokens])
    threshold = None
    if cfg.clean_loss and len(values):
        threshold = round(min(0.0, float(np.quantile(values, cfg.clean_loss))), 6)
    return {"words": model.common, "counts": model.counts, "threshold": threshold, "clean_loss": cfg.clean_loss,
            "top": cfg.top, "documents": len(tokens)}


def write(out: Path, calibrated: dict) -> dict:
    """`grammar.json` into the model's folder; the figures for its metrics (the counts left out)."""
    (out / GRAMMAR).write_text(json.dumps(calibrated, sort_keys=True))
    return {k: v for k, v in calibrated.items() if k != "counts"}


class Judge:
    """A model folder's grammar rule: `value(tokens)` and whether it `passes` (no threshold: all do)."""

    def __init__(self, model_dir: Path):
        path = model_dir / GRAMMAR
        rule = json.loads(path.read_text()) if path.exists() else {"words": [], "counts": [[0]], "threshold": None}
        self.model, self.threshold = Model(rule["words"], rule["counts"]), rule["threshold"]

    def value(self, tokens: list[str]) -> float:
        return self.model.value(tokens) if self.threshold is not None else 0.0

    def passes(self, value: float) -> bool:
        """Above the threshold (text with none of the common words, 0, does not pass zero)."""
        return self.threshold is None or value > self.threshold
