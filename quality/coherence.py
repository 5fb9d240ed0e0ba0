"""Coherence: whether a document reads as one text, the signal a bag-of-n-grams classifier lacks for documents
joined from two (a page whose second half is another page, two texts cut mid-sentence and concatenated).

Each side of such a junction is clean text, so the classifier scores the whole between its halves, both clean.
What it lacks is one vocabulary. For every cut point leaving at least `min_words` words on each side, this
takes the tf-idf cosine of the words before and after the cut (idf from the corpus sample: words found
everywhere weigh nothing, names and terms most), over the cosine that cut would have were the words in random
order; a document's coherence is the lowest ratio. A text that turns into another one has a cut where the two
sides share little; one text's two sides keep its names and its subject's words.
The threshold is a quantile (`clean_loss`) of the corpus sample's own coherences, so about that share of clean
documents goes. It reads the whole document (a junction can lie past what the classifier reads), in
O(n log n): adding a word of weight w seen c times to the prefix P grows |P|^2 by w^2 (2c + 1), and P.T
(T: the whole document's counts) by w^2 T[word], so every cut's cosine comes from two cumulative sums.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

COHERENCE = "coherence.json"
TOKEN = re.compile(r"\w+")


def words(text: str) -> list[str]:
    return TOKEN.findall(text.lower())


class Idf:
    """Inverse document frequencies from a corpus sample: log((N + 1) / (df + 1)), so a word in every sample
    document weighs nothing and a name found in one play weighs most. Only words in two or more documents are
    kept (a word in fewer weighs as one in one: the table stays small)."""

    def __init__(self, df: dict[str, int], documents: int):
        self.df, self.documents = df, documents

    @classmethod
    def of(cls, tokens: Sequence[list[str]]) -> Idf:
        df = Counter(w for ws in tokens for w in set(ws))
        return cls({w: n for w, n in sorted(df.items()) if n >= 2}, len(tokens))

    def squared(self, vocab: list[str]) -> np.ndarray:
        df = np.fromiter((self.df.get(w, 1) for w in vocab), dtype=np.float64, count=len(vocab))
        return np.log((self.documents + 1) / (df + 1)) ** 2


def coherence(ws: list[str], idf: Idf, min_words: int) -> float:
    """The lowest ratio, over the cuts leaving `min_words` words (of some weight) on each side, of the tf-idf
    cosine between the document's words `ws` (`words(text)`) before and after the cut to its `expected` value;
    1.0 for a document too short to cut (6 decimals, clipped to [0, 1])."""
    if len(ws) < 2 * min_words:
        return 1.0
    vocab = list(dict.fromkeys(ws))
    ids = np.fromiter(map(dict(zip(vocab, range(len(vocab)))).__getitem__, ws), dtype=np.int64, count=len(ws))
    w2 = idf.squared(vocab)[ids]  # each position's squared weight
    ids, w2 = ids[w2 > 0], w2[w2 > 0]  # words in every sample document weigh nothing: left out
    n = len(ids)
    if n < 2 * min_words:
        return 1.0
    total = np.bincount(ids).astype(np.float64)
    order = np.argsort(ids, kind="stable")
    starts = np.r_[0, np.flatnonzero(np.diff(ids[order])) + 1]
    seen = np.empty(n)  # how many times each word occurred before this position
    seen[order] = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))
    pp = np.cumsum(w2 * (2 * seen + 1))[min_words - 1: n - min_words]  # |P|^2 after each cut
    pt = np.cumsum(w2 * total[ids])[min_words - 1: n - min_words]  # P.T
    tt, wt = float((w2 * total[ids]).sum()), float(w2.sum())  # |T|^2; the sum of w^2 T over words
    cos = (pt - pp) / np.sqrt(pp * (tt - 2 * pt + pp))  # P.S / (|P||S|) with S = T - P
    return round(float(np.clip((cos / expected(n, tt, wt, min_words)).min(), 0.0, 1.0)), 6)


def expected(n: int, tt: float, wt: float, min_words: int) -> np.ndarray:
    """For each cut, the cosine it would have were the document's words in random order: its first k words a
    sample without replacement (hypergeometric counts), so that a short side or a wide vocabulary is not read
    as a junction. `tt` is the whole document's |T|^2 and `wt` the sum over words of weight^2 x count."""
    k = np.arange(min_words, n - min_words + 1, dtype=np.float64)
    a1, a2, spread = wt / n, tt / n**2, k * (n - k) / (n - 1)
    pp = spread * (a1 - a2) + k * k * a2  # E|P|^2
    ss = spread * (a1 - a2) + (n - k) ** 2 * a2  # E|S|^2
    return (k * tt / n - pp) / np.sqrt(pp * ss)  # E[P.S] / sqrt(E|P|^2 E|S|^2)


def calibrate(tokens: Sequence[list[str]], cfg) -> dict:
    """The idf of a corpus sample (each document's `words`) and the threshold: the `cfg.clean_loss` quantile of
    their coherences (documents below it are dropped; 0 keeps all)."""
    idf = Idf.of(tokens)
    values = np.array([coherence(ws, idf, cfg.min_words) for ws in tokens])
    threshold = round(float(np.quantile(values, cfg.clean_loss)), 6) if cfg.clean_loss and len(values) else 0.0
    return {"df": idf.df, "documents": idf.documents, "threshold": threshold, "clean_loss": cfg.clean_loss,
            "min_words": cfg.min_words, "too_short": int((values == 1.0).sum())}


def write(out: Path, calibrated: dict) -> dict:
    """`coherence.json` into the model's folder; the figures for its metrics (the idf table left out)."""
    (out / COHERENCE).write_text(json.dumps(calibrated, sort_keys=True))
    return {k: v for k, v in calibrated.items() if k != "df"}


class Judge:
    """A model folder's coherence rule: `value(tokens)` (`words(text)`) and whether it `passes`."""

    def __init__(self, model_dir: Path):
        path = model_dir / COHERENCE
        c = json.loads(path.read_text()) if path.exists() else {"df": {}, "documents": 0, "threshold": 0.0,
                                                               "min_words": 1}
        self.idf, self.threshold, self.min_words = Idf(c["df"], c["documents"]), c["threshold"], c["min_words"]

    def value(self, tokens: list[str]) -> float:
        return coherence(tokens, self.idf, self.min_words) if self.threshold > 0 else 1.0

    def passes(self, value: float) -> bool:
        return value >= self.threshold
