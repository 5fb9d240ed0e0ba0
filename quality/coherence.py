"""Coherence: whether a document reads as one text, the signal a bag-of-n-grams classifier lacks for documents
joined from two (a page whose second half is another page, two texts cut mid-sentence and concatenated).

Each side of such a junction is clean text, so the classifier scores the whole between its halves, both clean.
What it lacks is one vocabulary. For every cut point leaving at least `min_words` words on each side, this
takes the cosine of the word counts before and after the cut (the corpus's `common_words` most widespread words
left out: they are in every text), over the cosine that cut would have were the words in random order; a
document's coherence is the lowest ratio. A text that turns into another one
has a cut where the two sides share little; one text's two sides keep its names and its subject's words.
The threshold is a quantile (`clean_loss`) of the corpus sample's own coherences, so about that share of clean
documents goes. It reads the whole document (a junction can lie past what the classifier reads), in
O(n log n): adding a word seen c times to the prefix P grows |P|^2 by 2c + 1, and P.T (T: the whole
document's counts) by T[word], so every cut's cosine comes from two cumulative sums.
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


def common(texts: Sequence[str], n: int) -> list[str]:
    """The `n` words found in the most of `texts` (ties by the word: the same list for the same texts)."""
    df = Counter(w for t in texts for w in set(words(t)))
    return [w for w, _ in sorted(df.items(), key=lambda kv: (-kv[1], kv[0]))[:n]]


def coherence(text: str, stop: frozenset[str], min_words: int) -> float:
    """The lowest ratio, over the cuts leaving `min_words` words (not in `stop`) on each side, of the cosine
    between the word counts before and after the cut to its `expected` value; 1.0 for a document too short to
    cut (6 decimals, clipped to [0, 1])."""
    ws = [w for w in words(text) if w not in stop]
    n = len(ws)
    if n < 2 * min_words:
        return 1.0
    index: dict[str, int] = {}
    ids = np.fromiter((index.setdefault(w, len(index)) for w in ws), dtype=np.int64, count=n)
    total = np.bincount(ids).astype(np.float64)
    order = np.argsort(ids, kind="stable")
    starts = np.r_[0, np.flatnonzero(np.diff(ids[order])) + 1]
    seen = np.empty(n)  # how many times each word occurred before this position
    seen[order] = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))
    pp = np.cumsum(2 * seen + 1)[min_words - 1: n - min_words]  # |P|^2 after each cut
    pt = np.cumsum(total[ids])[min_words - 1: n - min_words]  # P.T
    tt = float(total @ total)
    cos = (pt - pp) / np.sqrt(pp * (tt - 2 * pt + pp))  # P.S / (|P||S|) with S = T - P
    return round(float(np.clip((cos / expected(n, tt, min_words)).min(), 0.0, 1.0)), 6)


def expected(n: int, tt: float, min_words: int) -> np.ndarray:
    """For each cut, the cosine it would have were the document's words in random order: its first k words a
    sample without replacement (hypergeometric counts), so that a short side or a wide vocabulary is not read
    as a junction. Its own `tt` (the sum of squared counts) is all it takes."""
    k = np.arange(min_words, n - min_words + 1, dtype=np.float64)
    a, spread = tt / n**2, k * (n - k) / (n - 1)
    pp = spread * (1 - a) + k * k * a  # E|P|^2
    ss = spread * (1 - a) + (n - k) ** 2 * a  # E|S|^2
    return (k * tt / n - pp) / np.sqrt(pp * ss)  # E[P.S] / sqrt(E|P|^2 E|S|^2)


def calibrate(texts: Sequence[str], cfg) -> dict:
    """The common words of `texts` (a corpus sample) and the threshold: the `cfg.clean_loss` quantile of their
    coherences (documents below it are dropped; 0 keeps all)."""
    stop = common(texts, cfg.common_words)
    values = np.array([coherence(t, frozenset(stop), cfg.min_words) for t in texts])
    threshold = round(float(np.quantile(values, cfg.clean_loss)), 6) if cfg.clean_loss and len(values) else 0.0
    return {"common_words": stop, "threshold": threshold, "clean_loss": cfg.clean_loss,
            "min_words": cfg.min_words, "documents": len(values),
            "too_short": int((values == 1.0).sum())}


def write(out: Path, calibrated: dict) -> dict:
    """`coherence.json` into the model's folder; the figures for its metrics (the word list left out)."""
    (out / COHERENCE).write_text(json.dumps(calibrated, sort_keys=True))
    return {k: v for k, v in calibrated.items() if k != "common_words"}


class Judge:
    """A model folder's coherence rule: `value(text)` and whether it `passes`."""

    def __init__(self, model_dir: Path):
        path = model_dir / COHERENCE
        c = json.loads(path.read_text()) if path.exists() else {"common_words": [], "threshold": 0.0,
                                                               "min_words": 1}
        self.stop, self.threshold, self.min_words = frozenset(c["common_words"]), c["threshold"], c["min_words"]

    def value(self, text: str) -> float:
        return coherence(text, self.stop, self.min_words) if self.threshold > 0 else 1.0

    def passes(self, value: float) -> bool:
        return value >= self.threshold
