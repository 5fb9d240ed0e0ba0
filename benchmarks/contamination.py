"""Contamination harness, hard: benchmark items planted in real documents under edits the matcher's
normaliser does not erase, hard negatives that share long n-grams with items, and datatrove's
`NGramsDecontFilter` on the same cases as a baseline.

Run: `python benchmarks/contamination.py [--config tiny] [--per-kind N] [--seed S]` after `moeflow fetch`.

Carriers are real documents of the fetched corpora (Python and kernel docs, Shakespeare); those either
system flags before anything is planted are the `quoted` negatives (they predate the benchmarks that
quote them: a flag is counted a false positive), the rest the `carrier` negatives. Into those, at a
paragraph break, it plants:
- `exact`: a whole item;
- `swap5`, `swap10`, `swap20`: the item with every k-th word replaced by a word of another item;
- `reordered`: the item's sentences in another order;
- `numbers`: the item with every number changed;
- `partial`: a window of 13-20 words of an item of 40 words or more.
Negatives: `boilerplate` (a span whose every n-gram occurs in more than `max_items_per_ngram` items:
phrasing common to a benchmark, not one item), `near_miss` (three spans of 8-12 of the matcher's words
from different items), `quoted` and `carrier`. Every positive is labelled `intact` when the planted text still
holds an n-gram of its item (the ground truth an n-gram matcher can reach): recall is given per kind for
intact and broken cases. datatrove's index is built here from the same item texts and n (its indexer's
own tokenisation, normalisation and hashing; no lighteval download). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import random
import re
import tempfile
import time
from pathlib import Path

import numpy as np

from moeflow import configs
from moeflow.dedup import contamination
from moeflow.sources import fetch

SENTENCE = re.compile(r"(?<=[.!?])\s+")
KINDS = ("exact", "swap5", "swap10", "swap20", "reordered", "numbers", "partial")


def carriers(limit: int) -> list[str]:
    files = sorted(glob.glob(str(fetch.tree("python3.11-doc") / "**/*.rst.txt"), recursive=True))
    files += sorted(glob.glob(str(fetch.tree("linux-doc-6.1") / "**/*.rst.gz"), recursive=True))[:800]
    files += sorted(glob.glob(str(fetch.tree("shakespeare") / "**/*.txt"), recursive=True))
    docs = []
    for f in files:
        raw = gzip.open(f).read() if f.endswith(".gz") else open(f, "rb").read()
        text = raw.decode("utf-8", "replace")
        docs += [text[i : i + 20_000] for i in range(0, len(text), 20_000)]  # plays become several documents
    random.Random(0).shuffle(docs)
    return docs[:limit]


def edit(kind: str, text: str, rng: random.Random, vocab: list[str]) -> str | None:
    """The item `text` under one edit kind; None when the item does not admit it."""
    toks = text.split()
    if kind == "exact":
        return text
    if kind.startswith("swap"):
        k = int(kind[4:])
        return " ".join(rng.choice(vocab) if (i + 1) % k == 0 else t for i, t in enumerate(toks))
    if kind == "reordered":
        sentences = [s for s in SENTENCE.split(text.replace("\n", " ")) if s.strip()]
        if len(sentences) < 3:
            return None
        order = list(range(len(sentences)))
        while order == sorted(order):
            rng.shuffle(order)
        return " ".join(sentences[i] for i in order)
    if kind == "numbers":
        if not re.search(r"\d", text):
            return None
        return re.sub(r"\d+", lambda m: str(int(m.group()) + rng.randint(1, 9)), text)
    if kind == "partial":
        if len(toks) < 40:
            return None
        size = rng.randint(13, 20)
        at = rng.randrange(len(toks) - size)
        return " ".join(toks[at : at + size])
    raise ValueError(kind)


def plant(carrier: str, insert: str, rng: random.Random) -> str:
    breaks = [m.end() for m in re.finditer(r"\n\s*\n", carrier)] or [len(carrier)]
    at = rng.choice(breaks)
    return carrier[:at] + insert + "\n\n" + carrier[at:]


def grams(text: str, n: int) -> set[int]:
    return set(contamination.window_hashes(contamination.words(text), n).tolist())


def boilerplate(items: list[str], n: int, common_above: int, rng: random.Random, want: int) -> list[str]:
    """Spans of items whose every n-gram occurs in more than `common_above` items."""
    per_item = [np.unique(contamination.window_hashes(contamination.words(t), n)) for t in items]
    uniq, counts = np.unique(np.concatenate(per_item), return_counts=True)
    common = set(uniq[counts > common_above].tolist())
    spans = []
    for t in rng.sample(items, len(items)):
        toks = contamination.words(t)
        hs = contamination.window_hashes(toks, n).tolist()
        run = [i for i, h in enumerate(hs) if h in common]
        if run and run[0] + n <= len(toks) and all(h in common for h in hs[run[0] : run[0] + 2]):
            spans.append(" ".join(toks[run[0] : run[0] + n + 1]))
        if len(spans) >= want:
            break
    return spans


class Datatrove:
    """datatrove's NGramsDecontFilter over an index of the same items, hashed as its indexer hashes."""

    def __init__(self, items: dict[str, list[str]], n: int, folder: Path):
        from datatrove.pipeline.decont import NGramsDecontConfig, NGramsDecontFilter
        from datatrove.utils.text import ngrams, simplify_text

        self.cfg = NGramsDecontConfig(n_grams=n)
        self.filter = NGramsDecontFilter(index_folder=str(folder), config=self.cfg)
        for bench, texts in items.items():
            hashes = {self.filter.hash_func(" ".join(g)) for t in texts for g in ngrams(
                self.filter.tokenizer.word_tokenize(simplify_text(t, self.cfg.norm_config)), n)}
            np.array(sorted(hashes), dtype=np.dtype(self.cfg.hash_config.np_descr)).tofile(
                folder / f"{bench}.index.hashes")

    def flags(self, text: str) -> bool:
        from datatrove.data import Document

        kept = self.filter.filter(Document(text=text, id="x"))
        return not (kept if isinstance(kept, bool) else kept[0])


def cases_for(items, clean, flagged, n, common_above, rng, per_kind) -> list[tuple[str, bool, str, bool]]:
    """(text, contaminated, kind, intact) for every case."""
    flat = [t for texts in items.values() for t in texts]
    vocab = [w for t in rng.sample(flat, 500) for w in t.split()]
    long_items = [t for t in flat if len(t.split()) >= 26]
    out = []
    for kind in KINDS:
        made = 0
        while made < per_kind:
            item = rng.choice(long_items)
            planted = edit(kind, item, rng, vocab)
            if planted is None:
                continue
            out.append((plant(rng.choice(clean), planted, rng), True, kind, bool(grams(planted, n) & grams(item, n))))
            made += 1
    for span in boilerplate(flat, n, common_above, rng, per_kind):
        out.append((plant(rng.choice(clean), span, rng), False, "boilerplate", False))
    for _ in range(per_kind):
        doc = rng.choice(clean)
        for t in rng.sample(long_items, 3):  # spans in the matcher's own words, so none holds an n-gram
            w, k = contamination.words(t), rng.randint(8, n - 1)
            s = rng.randrange(len(w) - k)
            doc = plant(doc, " ".join(w[s : s + k]), rng)
        out.append((doc, False, "near_miss", False))
    out += [(d, False, "quoted", False) for d in flagged]
    out += [(d, False, "carrier", False) for d in clean]
    return out


def tally(cases, flags: list[bool]) -> dict:
    """Precision, recall, and per-kind counts (positives: split intact / broken) for one system."""
    tp = sum(f and c[1] for c, f in zip(cases, flags))
    fp = sum(f and not c[1] for c, f in zip(cases, flags))
    fn = sum(c[1] and not f for c, f in zip(cases, flags))
    kinds: dict[str, list[int]] = {}
    for c, f in zip(cases, flags):
        key = c[2] + (("" if c[3] else "/broken") if c[1] else "")
        kinds.setdefault(key, [0, 0])
        kinds[key][0] += f
        kinds[key][1] += 1
    intact = [(c, f) for c, f in zip(cases, flags) if c[1] and c[3]]
    return {
        "precision": round(tp / max(1, tp + fp), 4),
        "recall": round(tp / max(1, tp + fn), 4),
        "recall_intact": round(sum(f for _, f in intact) / max(1, len(intact)), 4),
        "flagged_by_kind": {k: f"{h}/{t}" for k, (h, t) in sorted(kinds.items())},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--per-kind", type=int, default=200)
    p.add_argument("--carriers", type=int, default=1500)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    cfg = configs.load(args.config)
    d, n = cfg.decontaminate, cfg.decontaminate.ngram
    rng = random.Random(args.seed)
    items = {b.name: [t for _, t in contamination.items(b)] for b in cfg.benchmarks}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        built = contamination.build_index(cfg.benchmarks, d, Path(tmp))
        build_s = time.perf_counter() - t0
        index = contamination.Index(Path(tmp))
        ours = lambda text: index.matches(text, n)[0] >= d.min_matches  # noqa: E731
        t0 = time.perf_counter()
        base = Datatrove(items, n, Path(tmp))
        base_build_s = time.perf_counter() - t0
        docs = carriers(args.carriers)
        # carriers either system flags unplanted share n-grams with items they predate: `quoted` negatives;
        # the others (`carrier` negatives) host the planted cases
        either = [ours(x) or base.flags(x) for x in docs]
        flagged = [x for x, f in zip(docs, either) if f]
        clean = [x for x, f in zip(docs, either) if not f]
        cases = cases_for(items, clean, flagged, n, d.max_items_per_ngram, rng, args.per_kind)
        results = {}
        for name, check in (("moeflow", ours), ("datatrove", base.flags)):
            t0 = time.perf_counter()
            flags = [check(c[0]) for c in cases]
            seconds = time.perf_counter() - t0
            mb = sum(len(c[0].encode()) for c in cases) / 1e6
            results[name] = {**tally(cases, flags), "mb_per_s": round(mb / seconds, 2)}
    figures = {
        "config": cfg.name, "ngram": n, "benchmarks": len(cfg.benchmarks),
        "items": sum(len(v) for v in items.values()), "ngrams_indexed": built["ngrams"],
        "index_build_s": round(build_s, 1), "datatrove_index_build_s": round(base_build_s, 1),
        "cases": len(cases), "positives": sum(c[1] for c in cases),
        "positives_intact": sum(c[1] and c[3] for c in cases),
        "negatives": sum(not c[1] for c in cases), **results,
    }
    for name in ("moeflow", "datatrove"):
        r = results[name]
        print(f"{name:9} precision {r['precision']}  recall {r['recall']}  recall on intact cases "
              f"{r['recall_intact']}  {r['mb_per_s']} MB/s")
        print("          " + ", ".join(f"{k} {v}" for k, v in r["flagged_by_kind"].items()))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
