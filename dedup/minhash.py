"""MinHash signatures and their estimated Jaccard similarity, for near-duplicate detection by LSH banding.

A document's shingles are its word 5-grams (lower-cased `\\w+` words, hashed as in the contamination
index). Signature slot i is the minimum over shingles s of mix(s XOR key_i), mix being splitmix64's
finaliser, for all slots at once in numpy. (A linear (a*s + b) mod p family with 32-bit s and a
was tried first: it wraps p only a few times, so every slot picked nearly the same shingle and the
estimate of a 0.15 Jaccard pair came out 0.68.) Documents sharing one band (`rows` consecutive slots)
of the `bands` bands become candidates (`dedup.corpus` finds them); a candidate pair is joined when the
share of equal slots, the estimated Jaccard similarity, reaches `threshold`. With b bands of r rows a
pair of true similarity s becomes a candidate with probability 1 - (1 - s^r)^b.
"""

from __future__ import annotations

import numpy as np

from moeflow.tokenize.ngrams import window_hashes, words

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
EMPTY = np.uint64(0xFFFFFFFFFFFFFFFF)
CHUNK = 1024  # shingles hashed at once: two arrays of keys x CHUNK uint64s (0.9 MB each at 112 keys)


def permutations(num: int, seed: int) -> np.ndarray:
    """One random 64-bit key per signature slot."""
    return np.random.default_rng(seed).integers(0, 1 << 63, num, dtype=np.uint64)


def _mix(z: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """splitmix64's finaliser, in place on `z` (`scratch`: an array of its shape to overwrite): a bijection
    on uint64 whose outputs look independent for different keys. In place, a block needs two arrays, not
    seven (each new array of a large block is a fresh allocation that a worker's allocator keeps)."""
    scratch = np.empty_like(z) if scratch is None else scratch
    for shift, mult in ((30, _M1), (27, _M2)):
        np.right_shift(z, np.uint64(shift), out=scratch)
        z ^= scratch
        z *= mult  # wraps modulo 2^64, as intended (array arithmetic does not warn)
    np.right_shift(z, np.uint64(31), out=scratch)
    z ^= scratch
    return z


def signature(text: str, ngram: int, keys: np.ndarray) -> np.ndarray:
    toks = words(text)
    shingles = np.unique(window_hashes(toks, min(ngram, len(toks))) if toks else np.empty(0, np.uint64))
    sig = np.full(keys.size, EMPTY, dtype=np.uint64)
    width = min(CHUNK, shingles.size)
    z, scratch = np.empty((keys.size, width), np.uint64), np.empty((keys.size, width), np.uint64)
    for i in range(0, shingles.size, CHUNK):  # a block at a time: a 10 MB document needs no 1 GB array
        block = shingles[i:i + CHUNK]
        zb, sb = z[:, :block.size], scratch[:, :block.size]
        np.bitwise_xor(keys[:, None], block[None, :], out=zb)
        np.minimum(sig, _mix(zb, sb).min(axis=1), out=sig)
    return sig


def similarity(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
    return float(np.mean(sig_a == sig_b))
