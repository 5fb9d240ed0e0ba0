"""Membership of uint64 hashes in a large sorted array, fast: both decontamination tiers look up every word
window of every document, and most windows match nothing.

A 2^27-bit membership bitmap (16 MB) is probed first: a bitmap probe is one memory access where a binary
search over millions of sorted hashes is twenty (measured on the Python docs against the tiny preset's 4.5M
13-grams: 0.09 s instead of 2.0 s).
"""

from __future__ import annotations

import numpy as np


class SortedHashes:
    BITS = 27

    def __init__(self, hashes: np.ndarray):
        self.hashes = hashes
        self._mask = np.uint64((1 << self.BITS) - 1)
        present = np.zeros(1 << self.BITS, dtype=bool)
        present[(hashes & self._mask).astype(np.int64)] = True
        self._bitmap = np.packbits(present, bitorder="little")

    def lookup(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mask of `h` in the array, their positions in `hashes`)."""
        slots = (h & self._mask).astype(np.int64)
        maybe = ((self._bitmap[slots >> 3] >> (slots & 7).astype(np.uint8)) & 1).astype(bool)
        hit = np.zeros(h.size, dtype=bool)
        pos = np.zeros(h.size, dtype=np.int64)
        if maybe.any() and self.hashes.size:
            cand = np.flatnonzero(maybe)
            p = np.searchsorted(self.hashes, h[cand]).clip(max=self.hashes.size - 1)
            found = self.hashes[p] == h[cand]
            hit[cand[found]], pos[cand[found]] = True, p[found]
        return hit, pos
