"""Word n-gram hashes of text, as decontamination matches them: shared by `dedup` (benchmark contamination,
MinHash shingles) and the mix's held-out leakage check, which sits below it.

Normalisation: lower-case, words are `\\w+` runs (punctuation and whitespace ignored). An n-gram's hash
combines its words' xxh3 hashes with a polynomial over uint64, computed for all windows at once in numpy.
"""

from __future__ import annotations

import re

import numpy as np
import xxhash

WORD = re.compile(r"\w+")
_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit constant: the polynomial base of the rolling hash


def normalised(text: str) -> str:
    """What the index sees of a text: the text lower-cased. Its words are the `WORD` runs in this one
    string, for hashing (`words`) and for cutting (`dedup.contamination.word_spans`) alike, so word i is the
    same in both."""
    return text.lower()


def words(text: str) -> list[str]:
    return WORD.findall(normalised(text))


def word_hashes(toks: list[str]) -> np.ndarray:
    """uint64 xxh3 hash of each word: what `windows` combines, so one pass serves several window lengths."""
    return np.fromiter(map(xxhash.xxh3_64_intdigest, toks), dtype=np.uint64, count=len(toks))


def windows(wh: np.ndarray, n: int) -> np.ndarray:
    """uint64 hash of every window of n consecutive word hashes, in order (empty when fewer than n)."""
    if wh.size < n:
        return np.empty(0, dtype=np.uint64)
    m = wh.size - n + 1
    acc = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            acc = acc * _MULT + wh[j : j + m]
    return acc


def window_hashes(toks: list[str], n: int) -> np.ndarray:
    """uint64 hash of every window of n consecutive words, in order (empty when fewer than n words)."""
    if len(toks) < n:
        return np.empty(0, dtype=np.uint64)
    return windows(word_hashes(toks), n)


def ngram_hashes(text: str, n: int, min_alpha: int = 0) -> np.ndarray:
    """uint64 hashes of the word n-grams of `text` with at least `min_alpha` non-numeric words."""
    toks = words(text)
    acc = window_hashes(toks, n)
    if min_alpha and acc.size:
        alpha = np.concatenate([[0], np.cumsum([not t.isdigit() for t in toks])])
        acc = acc[(alpha[n:] - alpha[:-n]) >= min_alpha]
    return acc
