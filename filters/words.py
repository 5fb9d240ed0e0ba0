"""The `fast` filter engine's word splitter: spaCy's English tokenizer rules (its own prefix, suffix and
infix patterns and special cases, read from the spaCy model datatrove loads) applied in Python to the words
that need them; a word without punctuation is a token at once, with no spaCy `Doc` built, and each distinct
whitespace-separated chunk is split once a process (a bounded memo: words repeat, so most chunks of a
document were split before). filters/fast.py computes the filter statistics from its words;
benchmarks/corpus_scale.py measures how often the decisions agree with the `datatrove` engine's.
Sentences (C4's rules) still come from datatrove's own tokenizer.
"""

from __future__ import annotations

import re
from itertools import chain

from datatrove.utils.word_tokenizers import WordTokenizer, load_word_tokenizer

PLAIN = re.compile(r"[^\W\d_]+|\d+")  # letters alone or digits alone: no prefix, suffix or infix applies
MEMO_MAX = 500_000  # distinct chunks remembered; the memo starts again past it (a few tens of MB)


class _Memo(dict):
    """chunk -> its tokens, split on first sight."""

    def __init__(self, split):
        super().__init__()
        self.split = split

    def __missing__(self, chunk: str) -> tuple[str, ...]:
        self[chunk] = tokens = self.split(chunk)
        return tokens


class FastWords(WordTokenizer):
    """A datatrove word tokenizer for `language` that follows its spaCy tokenizer's rules; give it as a
    block's `language`."""

    def __init__(self, language: str):
        super().__init__()
        self.language = language
        rules = load_word_tokenizer(language).tokenizer.tokenizer
        self.prefix, self.suffix, self.infix = rules.prefix_search, rules.suffix_search, rules.infix_finditer
        self.token_match = rules.token_match or (lambda _: None)  # whole before affixes come off
        self.whole = [m for m in (rules.token_match, rules.url_match) if m is not None]  # whole after
        self.special = {k: [next(iter(t.values())) for t in v] for k, v in rules.rules.items()}
        self.memo = _Memo(self._chunk)

    def word_tokenize(self, text: str) -> list[str]:
        if len(self.memo) > MEMO_MAX:
            self.memo.clear()
        return list(chain.from_iterable(map(self.memo.__getitem__, text.split())))

    def _chunk(self, chunk: str) -> tuple[str, ...]:
        """One whitespace-free chunk's tokens."""
        if PLAIN.fullmatch(chunk) and chunk not in self.special:
            return (chunk,)
        out: list[str] = []
        self._split(chunk, out)
        return tuple(t for t in out if t.strip())

    def _split(self, string: str, out: list[str]) -> None:
        """spaCy's loop: prefixes and suffixes off while neither a special case nor a whole token is left,
        then the middle as a special case, a whole token or split at its infixes."""
        prefixes, suffixes = [], []
        while string and string not in self.special and not self.token_match(string):
            pre = self.prefix(string)
            if pre and pre.end():
                prefixes.append(string[: pre.end()])
                string = string[pre.end():]
                continue
            suf = self.suffix(string)
            if not suf or suf.end() == suf.start():
                break
            suffixes.append(string[suf.start():])
            string = string[: suf.start()]
        out += prefixes
        if string in self.special:
            out += self.special[string]
        elif string:
            self._infixes(string, out)
        out += reversed(suffixes)

    def _infixes(self, string: str, out: list[str]) -> None:
        if any(m(string) for m in self.whole):
            out.append(string)
            return
        start = 0
        for m in self.infix(string):
            if m.start() == 0 and m.end() == 0:
                continue
            if m.start() > start:
                out.append(string[start:m.start()])
            if m.end() > m.start():
                out.append(string[m.start():m.end()])
            start = m.end()
        if start < len(string):
            out.append(string[start:])

    def sent_tokenize(self, text: str) -> list[str]:
        return load_word_tokenizer(self.language).sent_tokenize(text)

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        return load_word_tokenizer(self.language).span_tokenize(text)

    def __repr__(self) -> str:  # what a block's repr and a log line show
        return f"FastWords({self.language!r})"


_MADE: dict[str, FastWords] = {}


def fast_words(language: str) -> FastWords:
    """One splitter a language, so datatrove's tokenizer cache (keyed by the object) stays small."""
    return _MADE.setdefault(language, FastWords(language))
