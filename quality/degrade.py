"""Synthetic negatives: generic degraded versions of corpus text, so that the classifier learns what broken text
looks like as a class, not only which topics the positives cover.

Positives against corpus documents (DCLM's recipe) teach a classifier topic: fluent text of another domain and
the same text broken (its words reordered, its small words gone, its phrases repeated) look alike to it. Each
degrader here takes one document's words (and, for the sampling ones, word statistics of the corpus sample) and
returns a degraded version; `quality_model` labels them negatives next to the corpus sample (the kinds and how
many per document: `quality.synthetic_negatives`). They are written from what low-quality text is (incoherent,
repetitive, ungrammatical), seeded, and never read any benchmark's junk generators.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Words = list[str]


@dataclass
class WordModel:
    """Unigram and bigram statistics of the documents given: every token, and each token's followers."""

    tokens: Words = field(default_factory=list)
    followers: dict[str, Words] = field(default_factory=dict)
    common: Words = field(default_factory=list)  # lower-cased, most frequent first

    @classmethod
    def of(cls, texts: Sequence[str]) -> WordModel:
        model = cls()
        for text in texts:
            words = text.split()
            model.tokens.extend(words)
            for a, b in zip(words, words[1:], strict=False):
                model.followers.setdefault(a, []).append(b)
        counts = Counter(w.lower() for w in model.tokens)
        model.common = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
        return model


def unigram(words: Words, model: WordModel, rng: random.Random) -> Words:
    """As many tokens drawn from the corpus's unigram distribution: its vocabulary, no order at all."""
    return rng.choices(model.tokens, k=len(words)) if model.tokens else words


def bigram(words: Words, model: WordModel, rng: random.Random) -> Words:
    """A walk of the corpus's bigram chain, as long as the document: each word pair occurs in the corpus,
    longer stretches make no sense (a dead end restarts from a random token)."""
    if not model.tokens:
        return words
    out = [rng.choice(model.tokens)]
    while len(out) < len(words):
        nxt = model.followers.get(out[-1])
        out.append(rng.choice(nxt) if nxt else rng.choice(model.tokens))
    return out


def window_shuffle(words: Words, model: WordModel, rng: random.Random) -> Words:
    """Words reordered within consecutive windows of 3 to 8: the topic and rough position stay, syntax goes."""
    out: Words = []
    i = 0
    while i < len(words):
        size = rng.randint(3, 8)
        window = words[i: i + size]
        rng.shuffle(window)
        out.extend(window)
        i += size
    return out


def token_drop(words: Words, model: WordModel, rng: random.Random) -> Words:
    """A random 30% to 60% of the tokens removed: telegraphic text whose neighbours no longer belong together."""
    p = rng.uniform(0.3, 0.6)
    kept = [w for w in words if rng.random() >= p]
    return kept or words[:1]


def repeat_span(words: Words, model: WordModel, rng: random.Random) -> Words:
    """A few short spans of the document, each repeated over and over, filling its length: boilerplate-like."""
    if len(words) < 4:
        return words * 4
    spans = []
    for _ in range(rng.randint(1, 3)):
        size = rng.randint(2, min(12, len(words)))
        start = rng.randrange(len(words) - size + 1)
        spans.append(words[start: start + size])
    out: Words = []
    while len(out) < len(words):
        out.extend(rng.choice(spans))
    return out


def patchwork(words: Words, model: WordModel, rng: random.Random) -> Words:
    """Runs of 5 to 40 consecutive corpus tokens from random places, joined: each run reads, the whole does not."""
    if len(model.tokens) < 2:
        return words
    out: Words = []
    while len(out) < len(words):
        size = rng.randint(5, 40)
        start = rng.randrange(max(1, len(model.tokens) - size))
        out.extend(model.tokens[start: start + size])
    return out[: len(words)]


def keywords(words: Words, model: WordModel, rng: random.Random) -> Words:
    """The document without most of the corpus's commonest words (its 30 to 300 most frequent): a keyword list
    that keeps the topic and loses the grammar, as pages stuffed for search engines are."""
    common = set(model.common[: rng.randint(30, 300)])
    p = rng.uniform(0.7, 1.0)
    kept = [w for w in words if w.lower() not in common or rng.random() >= p]
    return kept or words[:1]


DEGRADERS: dict[str, Callable[[Words, WordModel, random.Random], Words]] = {
    "unigram": unigram, "bigram": bigram, "window_shuffle": window_shuffle, "token_drop": token_drop,
    "repeat_span": repeat_span, "patchwork": patchwork, "keywords": keywords,
}


def degrade(texts: Sequence[str], kinds: Sequence[str], per_document: float, sample: Sequence[str],
            seed: int) -> list[tuple[str, str]]:
    """(kind, text): about `per_document` degraded versions of each of `texts`, kinds taken in turn, seeded.
    `sample` (corpus documents) gives the unigram and bigram statistics."""
    unknown = sorted(set(kinds) - set(DEGRADERS))
    if unknown:
        raise ValueError(f"unknown degrader(s) {unknown}; known: {sorted(DEGRADERS)}")
    if not kinds:
        return []
    rng = random.Random(seed)
    model = WordModel.of(sample)
    n = round(per_document * len(texts))
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        words = texts[rng.randrange(len(texts))].split()
        out.append((kind, " ".join(DEGRADERS[kind](words, model, rng))))
    return out
