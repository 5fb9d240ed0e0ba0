"""The decontamination review: a flagged document's matched window beside the benchmark item, the matched words
marked, so that a person can check a flag before trusting it (the lineage report and `moeflow explain` show it).
"""

from __future__ import annotations

import re

CONTEXT = 160  # characters of the text shown before the first matched span and after the last
MAX_CHARS = 1500  # at most this much of the item, and of the document window, is shown
PER_BENCHMARK = 20  # the weakest flags of each benchmark kept for review (the ones most worth a second look)
_SPECIAL = re.compile(r"([\\`*_\[\]<>|#])")


def _escaped(text: str) -> str:
    """Plain text safe in a Markdown table cell: its markup characters escaped, its whitespace one space."""
    return _SPECIAL.sub(r"\\\1", re.sub(r"\s+", " ", text))


def marked(text: str, spans: list[list[int]]) -> str:
    """An excerpt of `text` around `spans` (character ranges), each span in bold, as Markdown."""
    if not spans:
        return _escaped(text[:MAX_CHARS]) + (" …" if len(text) > MAX_CHARS else "")
    lo = max(0, spans[0][0] - CONTEXT)
    hi = min(len(text), spans[-1][1] + CONTEXT, lo + MAX_CHARS)
    out, at = ["… " if lo else ""], lo
    for a, b in spans:
        a, b = max(a, at), min(b, hi)
        if a >= b:
            continue
        out += [_escaped(text[at:a]), "**", _escaped(text[a:b]).strip(), "**"]
        at = b
    out += [_escaped(text[at:hi]), " …" if hi < len(text) else ""]
    return "".join(out)


def entry(doc_id: str, text: str, found: dict, item_text: str) -> dict:
    """One review row: the document, its flag (tier, item, strength) and both sides marked."""
    return {"doc_id": doc_id, "benchmark": found["benchmark"], "item_id": found["item_id"],
            "tier": found["tier"], "strength": found["strength"],
            "item": marked(item_text, found.get("item_spans", [])),
            "window": marked(text, found.get("spans", []))}


def weakest(rows: list[dict]) -> list[dict]:
    """The rows kept for review: the weakest flags first, in an order that does not depend on sharding."""
    return sorted(rows, key=lambda r: (r["strength"], r["doc_id"], r["item_id"]))[:PER_BENCHMARK]
