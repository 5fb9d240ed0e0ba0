"""Decontamination's second tier: benchmark items leaked under edits (words substituted, inserted or dropped
every few words) that leave no intact long n-gram for the first tier, found without losing precision.

Index: every item's word `edited_ngram`-grams (3 words by default: some survive an edit every fourth word), each
hash with every item it occurs in (n-grams in more than `max_items_per_ngram` items are left out, as in the
first tier), and each item's count of them.
Candidates: a document's short n-grams looked up; an item is a candidate when at least `MIN_FRACTION` of its
indexed n-grams (and `MIN_HITS`) occur within a span of the document not much longer than the item.
Verification, before any flag: an exact longest common subsequence of words between the item and that window.
Its runs of at least `MIN_RUN` words (a lone common word matched by chance does not count) are the matched
spans; their words over the item's are the strength, which must reach `edited_min_strength`, and they must
hold `edited_min_words` words.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeflow.dedup.lookup import SortedHashes
from moeflow.tokenize.ngrams import ngram_hashes, windows, word_hashes, words

MIN_FRACTION = 0.15  # an edit every 4th word leaves a quarter of an item's 3-grams
MIN_HITS = 3
MIN_RUN = 2
CACHED = 4096
SPAN_SLACK = 1.5  # the densest span searched is at most this times the item's words (plus 2 n-grams)


def short_alpha(min_alpha_words: int, ngram: int, short: int) -> int:
    """The first tier's share of non-numeric words, for the shorter n-gram (numbers alone signal no leak)."""
    return -(-min_alpha_words * short // ngram)


class Builder:
    """Collects each item's short n-grams while the index is built; `arrays` gives what `index.npz` holds."""

    def __init__(self, n: int, min_alpha: int):
        self.n, self.min_alpha = n, min_alpha
        self.hashes: list[np.ndarray] = []
        self.words: list[int] = []

    def add(self, text: str) -> None:
        self.hashes.append(np.unique(ngram_hashes(text, self.n, min_alpha=self.min_alpha)))
        self.words.append(len(words(text)))

    def arrays(self, max_items: int) -> dict[str, np.ndarray]:
        owners = np.repeat(np.arange(len(self.hashes), dtype=np.int32), [h.size for h in self.hashes])
        all_h = np.concatenate(self.hashes) if self.hashes else np.empty(0, np.uint64)
        order = np.argsort(all_h, kind="stable")
        all_h, owners = all_h[order], owners[order]
        uniq, counts = np.unique(all_h, return_counts=True)
        keep = counts <= max_items
        owners = owners[np.repeat(keep, counts)]
        return {"edit_ngram": np.array(self.n), "edit_hashes": uniq[keep],
                "edit_offsets": np.concatenate([[0], np.cumsum(counts[keep])]).astype(np.int32),
                "edit_owners": owners, "edit_counts": np.bincount(owners, minlength=len(self.hashes)),
                "item_words": np.array(self.words, dtype=np.int64)}


@dataclass
class Found:
    """One verified item: its index row, strength, and the matched runs [first word, end word) of the document
    and, in the same order, of the item."""

    row: int
    strength: float
    runs: list[tuple[int, int]]
    item_runs: list[tuple[int, int]]

    @property
    def matched(self) -> int:
        return sum(b - a for a, b in self.runs)


class Matcher:
    """The loaded second tier (`arrays` of the index) and the item texts it verifies against."""

    def __init__(self, data, texts: list[str]):
        self.n, self.texts = int(data["edit_ngram"]), texts
        self.set = SortedHashes(data["edit_hashes"])
        self.offsets, self.owners = data["edit_offsets"], data["edit_owners"]
        self.counts, self.item_words = data["edit_counts"], data["item_words"]
        self._words: dict[int, np.ndarray] = {}

    def candidates(self, wh: np.ndarray) -> list[tuple[int, int, int]]:
        """(item row, first word, end word) of each item whose short n-grams cluster densely enough in the
        document (word hashes `wh`), most hits first."""
        hit, pos = self.set.lookup(windows(wh, self.n))
        at, g = np.flatnonzero(hit), pos[hit]
        counts = self.offsets[g + 1] - self.offsets[g]
        if not counts.sum():
            return []
        base = np.repeat(self.offsets[g] - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
        own = self.owners[base + np.arange(int(counts.sum()))]
        at = np.repeat(at, counts)
        rows, per = np.unique(own, return_counts=True)
        need = np.maximum(MIN_HITS, MIN_FRACTION * self.counts[rows])
        found = []
        for row, k in zip(rows[per >= need].tolist(), need[per >= need].tolist()):
            dense = self._densest(np.sort(at[own == row]), int(self.item_words[row]))
            if dense[0] >= k:
                found.append((dense[0], row, dense[1], dense[2]))
        return [(row, a, b) for _, row, a, b in sorted(found, key=lambda f: (-f[0], f[1]))]

    def _densest(self, p: np.ndarray, item_words: int) -> tuple[int, int, int]:
        """(hits, first word, end word) of the span of at most SPAN_SLACK x the item that holds most hits."""
        ends = np.searchsorted(p, p + int(SPAN_SLACK * item_words) + 2 * self.n, side="right")
        k = int(np.argmax(ends - np.arange(p.size)))
        return int(ends[k] - k), int(p[k]), int(p[ends[k] - 1]) + self.n

    def item_hashes(self, row: int) -> np.ndarray:
        """The item's word hashes, cached (a passage's items are checked together) up to `CACHED` items, then
        afresh."""
        if len(self._words) > CACHED:
            self._words.clear()
        if row not in self._words:
            self._words[row] = word_hashes(words(self.texts[row]))
        return self._words[row]

    def verify(self, row: int, doc: np.ndarray, a: int, b: int) -> Found:
        """Align item `row` with the document's word hashes `doc` around [a, b)."""
        item = self.item_hashes(row)
        lo, hi = max(0, a - self.n), min(doc.size, b + self.n)
        runs = [(i, lo + j, k) for i, j, k in lcs_runs(item, doc[lo:hi]) if k >= MIN_RUN]
        return Found(row, round(sum(k for _, _, k in runs) / max(1, item.size), 4),
                     [(j, j + k) for _, j, k in runs], [(i, i + k) for i, _, k in runs])


def lcs_runs(a: np.ndarray, b: np.ndarray) -> list[tuple[int, int, int]]:
    """(start in `a`, start in `b`, length) of each run that a longest common subsequence of `a` and `b` matches
    contiguously in both.

    Row i of the table is the running maximum of max(previous row, previous row shifted + equal), so each row
    is a few numpy operations; the walk back is in Python, over at most len(a) + len(b) steps."""
    if not a.size or not b.size:
        return []
    table = np.zeros((a.size + 1, b.size + 1), dtype=np.int32)
    for i in range(a.size):
        prev = table[i]
        table[i + 1, 1:] = np.maximum.accumulate(np.maximum(prev[1:], prev[:-1] + (b == a[i])))
    pairs = []
    i, j = a.size, b.size
    while i and j:
        if a[i - 1] == b[j - 1] and table[i, j] == table[i - 1, j - 1] + 1:
            pairs.append((i - 1, j - 1))
            i, j = i - 1, j - 1
        elif table[i - 1, j] >= table[i, j - 1]:
            i -= 1
        else:
            j -= 1
    return _runs(pairs[::-1])


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Matched (a, b) index pairs, in order, joined where both sides are consecutive."""
    runs: list[list[int]] = []
    for i, j in pairs:
        if runs and i == runs[-1][0] + runs[-1][2] and j == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([i, j, 1])
    return [(i, j, k) for i, j, k in runs]
