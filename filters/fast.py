"""The `fast` filter engine's own statistics: datatrove's Gopher repetition, Gopher quality, C4 and FineWeb
rules computed by moeflow from one word split a document that every step shares, with the n-gram counts in
numpy, each statistic computed only when the rules before it passed (as the blocks do).

Settings are the blocks' own: each step builds its datatrove block from the config exactly as the
`datatrove` engine does and reads its thresholds from it, so defaults and validation cannot drift apart.
Reasons are datatrove's strings. What "the same" means, statistic by statistic:
- duplicate paragraphs and lines: each occurrence after a part's first counts, with its characters;
- top n-grams: the n-gram (words joined by a space) seen most often, ties to the one seen first, times
  its characters;
- duplicated n-grams: windows of n words joined with no separator (so "ab c" and "a bc" are one n-gram),
  scanned left to right, a window already seen counting its characters and the scan jumping past it;
  windows are grouped by a polynomial hash of their characters and a match within a group is confirmed on
  the characters themselves;
- C4 splits a line into sentences (datatrove's spaCy sentencizer) only while the document has fewer
  sentences than it needs: every kept line adds at least one.
benchmarks/corpus_scale.py and tests/test_filters_dedup.py measure the decisions against the blocks'.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable
from functools import cached_property

import numpy as np
from datatrove.data import Document
from datatrove.pipeline import filters as dt
from datatrove.pipeline.filters import c4_filters
from datatrove.utils.text import PUNCTUATION_SET, split_into_sentences

from moeflow.filters.words import FastWords

Verdict = bool | tuple[bool, str]
BASE = 0x100000001B3  # odd: invertible modulo 2**64
BASE_INV = pow(BASE, -1, 1 << 64)
LEN_MIX = np.uint64(0x9E3779B97F4A7C15)


class Split:
    """One text's words (the fast splitter's) and the arrays the statistics share, each made on first use."""

    def __init__(self, text: str, words: list[str]):
        self.text, self.words, self.n = text, words, len(words)

    @cached_property
    def offsets(self) -> np.ndarray:
        """Where each word starts in the words joined with no separator (n + 1 entries)."""
        out = np.zeros(self.n + 1, np.int64)
        np.cumsum(np.fromiter(map(len, self.words), np.int64, self.n), out=out[1:])
        return out

    @cached_property
    def offset_list(self) -> list[int]:
        return self.offsets.tolist()

    @cached_property
    def joined(self) -> str:
        return "".join(self.words)

    @cached_property
    def ids(self) -> tuple[np.ndarray, list[str]]:
        """Each word's index among the text's distinct words (in order of first use), and those words."""
        distinct = list(dict.fromkeys(self.words))
        index = {w: i for i, w in enumerate(distinct)}
        return np.fromiter(map(index.__getitem__, self.words), np.int64, self.n), distinct

    @cached_property
    def prefix(self) -> tuple[np.ndarray, np.ndarray]:
        """Prefix sums of the joined words' characters times BASE_INV**position, and BASE**position (mod 2**64)."""
        codes = np.frombuffer(self.joined.encode("utf-32-le", "surrogatepass"), "<u4").astype(np.uint64) + 1
        size = len(codes)
        inv, fwd = np.full(size + 1, BASE_INV, np.uint64), np.full(size + 1, BASE, np.uint64)
        inv[0] = fwd[0] = 1
        inv, fwd = np.cumprod(inv, dtype=np.uint64), np.cumprod(fwd, dtype=np.uint64)
        sums = np.zeros(size + 1, np.uint64)
        np.cumsum(codes * inv[:size], out=sums[1:])
        return sums, fwd

    def window_hashes(self, n: int) -> np.ndarray:
        """A hash of each window of n words joined with no separator: equal characters, equal hash."""
        sums, fwd = self.prefix
        start, end = self.offsets[:-n], self.offsets[n:]
        return (sums[end] - sums[start]) * fwd[start] + (end - start).astype(np.uint64) * LEN_MIX

    def word_flags(self) -> tuple[np.ndarray, np.ndarray]:
        """Per word: has a character outside datatrove's punctuation, has a letter."""
        ids, distinct = self.ids
        wordy = np.fromiter((not PUNCTUATION_SET.issuperset(w) for w in distinct), bool, len(distinct))
        alpha = np.fromiter((any(map(str.isalpha, w)) for w in distinct), bool, len(distinct))
        return wordy[ids], alpha[ids]


class Words:
    """The shared split: a step asks for the current text's; C4's rewrite gives the next step a new one."""

    def __init__(self, splitter: FastWords):
        self.splitter = splitter
        self.last: Split | None = None

    def __call__(self, text: str) -> Split:
        if self.last is None or self.last.text is not text:
            self.last = Split(text, self.splitter.word_tokenize(text))
        return self.last


def duplicates(parts: list[str]) -> tuple[int, int]:
    """Occurrences after each part's first, and their characters."""
    distinct = set(parts)
    return len(parts) - len(distinct), sum(map(len, parts)) - sum(map(len, distinct))


def top_ngram_chars(split: Split, n: int) -> int | None:
    """Characters of the most frequent space-joined n-gram (ties: the first seen) times its count; None
    without n words."""
    count = split.n - n + 1
    if count <= 0:
        return None
    ids, distinct = split.ids
    if len(distinct) ** n < 2**63:  # each n-gram packs into one integer exactly
        keys = np.zeros(count, np.int64)
        for k in range(n):
            keys = keys * len(distinct) + ids[k:k + count]
        grams, counts = np.unique(keys, return_counts=True)
        most = int(counts.max())
        at = 0 if most == 1 else int(np.flatnonzero(np.isin(keys, grams[counts == most]))[0])
    else:
        grams = Counter(zip(*(split.words[k:k + count] for k in range(n))))
        gram, most = max(grams.items(), key=lambda kv: kv[1])  # the first of the most frequent
        at = next(i for i in range(count) if tuple(split.words[i:i + n]) == gram)
    return int(split.offsets[at + n] - split.offsets[at] + n - 1) * most


def repeated_chars(split: Split, n: int) -> int:
    """Characters of the windows of n words (joined with no separator) already seen, the scan jumping n words
    past each. Only windows whose hash occurred before are visited: a window repeats when an earlier window
    with the same characters was seen (not jumped over)."""
    count = max(0, split.n - n + 1)
    bits = max(1, count.bit_length())
    # a window's key: its hash's top bits, then its position, so sorting groups equal hashes in position order
    keys = np.sort((split.window_hashes(n) >> np.uint64(bits) << np.uint64(bits)) | np.arange(count, dtype=np.uint64)
                   if count else np.zeros(0, np.uint64))
    ranked = keys >> np.uint64(bits)
    later = np.flatnonzero(ranked[1:] == ranked[:-1]) + 1  # ranks of windows whose hash occurred before
    if not len(later):
        return 0
    positions = (keys & np.uint64((1 << bits) - 1)).astype(np.int64)
    starts = np.ones(count, bool)
    starts[later] = False
    group = np.maximum.accumulate(np.where(starts, np.arange(count), 0))  # the rank of the hash's first window
    visit = later[np.argsort(positions[later], kind="stable")]
    at, ranks, firsts, where = positions[visit].tolist(), visit.tolist(), group[visit].tolist(), positions.tolist()
    off, joined, jumped = split.offset_list, split.joined, bytearray(count)
    total = k = 0
    while k < len(at):
        i, earlier = at[k], map(where.__getitem__, range(firsts[k], ranks[k]))  # same hash, in position order
        window = joined[off[i]:off[i + n]]
        if any(not jumped[j] and joined[off[j]:off[j + n]] == window for j in earlier):
            total += off[i + n] - off[i]
            jumped[i:i + n] = b"\x01" * (min(i + n, count) - i)
            k = bisect_left(at, i + n, k + 1)  # the windows it jumps over are not visited
        else:
            k += 1
    return total


def repetition(block: dt.GopherRepetitionFilter, words: Words) -> Callable[[Document], Verdict]:
    """Gopher repetition with `block`'s settings."""

    def check(doc: Document) -> Verdict:
        text = doc.text
        if not text:
            return False, "empty"
        paragraphs = block.paragraph_exp.split(text.strip())
        count, chars = duplicates(paragraphs)
        if block.dup_para_frac and count / len(paragraphs) > block.dup_para_frac:
            return False, "dup_para_frac"
        if block.dup_para_char_frac and chars / len(text) > block.dup_para_char_frac:
            return False, "dup_para_char_frac"
        lines = block._line_splitter.split(text)
        count, chars = duplicates(lines)
        if block.dup_line_frac and count / len(lines) > block.dup_line_frac:
            return False, "dup_line_frac"
        if block.dup_line_char_frac and chars / len(text) > block.dup_line_char_frac:
            return False, "dup_line_char_frac"
        split = words(text)
        for n, frac in block.top_n_grams:
            top = top_ngram_chars(split, n)
            if top is not None and top / len(text) > frac:
                return False, f"top_{n}_gram"
        for n, frac in block.dup_n_grams:
            if repeated_chars(split, n) / len(text) > frac:
                return False, f"duplicated_{n}_n_grams"
        return True

    return check


def quality(block: dt.GopherQualityFilter, words: Words) -> Callable[[Document], Verdict]:
    """Gopher quality with `block`'s settings."""

    def check(doc: Document) -> Verdict:
        text, split = doc.text, words(doc.text)
        wordy, alpha = split.word_flags()
        kept = int(wordy.sum())
        if block.min_doc_words and kept < block.min_doc_words:
            return False, "gopher_short_doc"
        if block.max_doc_words and kept > block.max_doc_words:
            return False, "gopher_long_doc"
        lengths = np.diff(split.offsets)[wordy]
        mean = int(lengths.sum()) / kept if kept else math.nan
        if block.min_avg_word_length and mean < block.min_avg_word_length:
            return False, "gopher_below_avg_threshold"
        if block.max_avg_word_length and mean > block.max_avg_word_length:
            return False, "gopher_above_avg_threshold"
        verdict = _symbols_and_lines(block, text, split.n)
        if verdict is not True:
            return verdict
        if block.max_non_alpha_words_ratio and int(alpha.sum()) / split.n < block.max_non_alpha_words_ratio:
            return False, "gopher_below_alpha_threshold"
        if block.min_stop_words and len(block.stop_words.intersection(split.words)) < block.min_stop_words:
            return False, "gopher_enough_stop_words"
        return True

    return check


def _symbols_and_lines(block: dt.GopherQualityFilter, text: str, n_words: int) -> Verdict:
    if block.max_symbol_word_ratio and text.count("#") / n_words > block.max_symbol_word_ratio:
        return False, "gopher_too_many_hashes"
    if block.max_symbol_word_ratio and (text.count("...") + text.count("…")) / n_words > block.max_symbol_word_ratio:
        return False, "gopher_too_many_ellipsis"
    lines = text.splitlines()
    if block.max_bullet_lines_ratio and (
        sum(s.lstrip().startswith(("•", "-")) for s in lines) / len(lines) > block.max_bullet_lines_ratio
    ):
        return False, "gopher_too_many_bullets"
    if block.max_ellipsis_lines_ratio and (
        sum(s.rstrip().endswith(("...", "…")) for s in lines) / len(lines) > block.max_ellipsis_lines_ratio
    ):
        return False, "gopher_too_many_end_ellipsis"
    return True


def fineweb(block: dt.FineWebQualityFilter, words: Words) -> Callable[[Document], Verdict]:
    """FineWeb quality with `block`'s settings."""

    def check(doc: Document) -> Verdict:
        text = doc.text
        lines = [line for line in text.split("\n") if line.strip() != ""]
        if not lines:
            return False, "empty"
        ratio = sum(1 for line in lines if line.endswith(block.stop_chars)) / len(lines)
        if ratio < block.line_punct_thr and not (ratio == 0 and block.line_punct_exclude_zero):
            return False, "line_punct_ratio"
        if sum(1 for line in lines if len(line) <= block.short_line_length) / len(lines) > block.short_line_threshold:
            return False, "short_line_ratio"
        if duplicates(lines)[1] / len(text.replace("\n", "")) > block.char_duplicates_ratio:
            return False, "char_dup_ratio"
        if text.count("\n") / words(text).n > block.new_line_ratio:
            return False, "list_ratio"
        return True

    return check


def c4(block: dt.C4QualityFilter, words: Words) -> Callable[[Document], Verdict]:
    """C4 quality with `block`'s settings; it rewrites `doc.text` to the lines it keeps."""

    def check(doc: Document) -> Verdict:
        paragraph = block.split_paragraph
        lines = doc.text.splitlines() if paragraph else split_into_sentences(doc.text, block.language)
        sentences, kept = 0, []
        for line in lines:
            verdict = _c4_line(block, line.strip())
            if isinstance(verdict, tuple):
                return verdict
            if verdict is None:
                continue
            if block.min_num_sentences != -1 and sentences < block.min_num_sentences:  # later lines cannot lower it
                sentences += len(split_into_sentences(verdict, block.language)) if paragraph else 1
            kept.append(verdict)
        if sentences < block.min_num_sentences:
            return False, "too_few_sentences"
        doc.text = ("\n" if paragraph else " ").join(kept).strip()
        return True

    return check


def _c4_line(block: dt.C4QualityFilter, line: str) -> str | None | tuple[bool, str]:
    """The line as C4 keeps it, None when it drops the line, or the document's verdict."""
    words = line.split()
    if block.max_word_length != -1 and any(len(w) > block.max_word_length for w in words):
        return None
    if block.remove_citations:
        line = c4_filters.CITATION_REGEX.sub("", line)
    if block.filter_no_terminal_punct and (
        not line.endswith(c4_filters.END_PUNCTUATION) or line.endswith(c4_filters.ELLIPSIS)
    ):
        return None
    if len(words) < block.min_words_per_line:
        return None
    lower = line.lower()
    if block.filter_lorem_ipsum and "lorem ipsum" in lower:
        return False, "lorem_ipsum"
    if block.filter_javascript and "javascript" in lower:
        return None
    if block.filter_curly_bracket and "{" in line:
        return False, "curly_bracket"
    if block.filter_policy and any(p in lower for p in c4_filters.POLICY_SUBSTRINGS):
        return None
    return line


STEPS = {"gopher_repetition": repetition, "gopher_quality": quality, "c4": c4, "fineweb": fineweb}


def check(step: str, block, words: Words) -> Callable[[Document], Verdict]:
    """The fast engine's check for `step`: moeflow's own statistics where this module has them; a datatrove
    block it has none for (one added to DATATROVE_FILTERS) runs as it is, given the fast splitter."""
    if step in STEPS:
        return STEPS[step](block, words)
    block.language = words.splitter
    return block.filter
