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
# edits not used to choose the second tier's settings, to show it is not fitted to the kinds above
OWN_KINDS = ("random15", "insdel", "casepunct")


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
    if kind in OWN_KINDS:
        return own_edit(kind, toks, rng, vocab)
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


def own_edit(kind: str, toks: list[str], rng: random.Random, vocab: list[str]) -> str:
    """`random15`: each word replaced with probability 0.15; `insdel`: before each word, a word inserted or
    the word deleted, each with probability 0.08; `casepunct`: each word's case flipped or a comma or
    full stop attached after it, with probability 0.3."""
    out: list[str] = []
    for t in toks:
        r = rng.random()
        if kind == "random15":
            out.append(rng.choice(vocab) if r < 0.15 else t)
        elif kind == "insdel":
            out += [rng.choice(vocab), t] if r < 0.08 else ([] if r < 0.16 else [t])
        else:
            out.append(t.swapcase() if r < 0.15 else t + rng.choice(",.") if r < 0.3 else t)
    return " ".join(out)


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
    for kind in KINDS + OWN_KINDS:
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
    """Precision, recall (over the harness's kinds, and over the OWN_KINDS apart), and per-kind counts
    (positives: split intact / broken) for one system."""
    own = [(c, f) for c, f in zip(cases, flags) if c[2] in OWN_KINDS]
    cases, flags = zip(*[(c, f) for c, f in zip(cases, flags) if c[2] not in OWN_KINDS])
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
        "recall_own_kinds": round(sum(f for _, f in own) / max(1, len(own)), 4),
        "flagged_by_kind": {k: f"{h}/{t}" for k, (h, t) in sorted(kinds.items())}
        | {c[2]: f"{sum(f for d, f in own if d[2] == c[2])}/{sum(d[2] == c[2] for d, _ in own)}" for c, _ in own},
    }


def tiers(cases, found: list[list]) -> dict:
    """Cases flagged per tier (the first flag's), positives and negatives apart."""
    out: dict[str, int] = {}
    for c, flags in zip(cases, found):
        if flags:
            key = f"{flags[0].tier}/{'positive' if c[1] else 'negative'}"
            out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def timed(check, cases) -> tuple[list, float]:
    """Each case checked in this one process; MB/s over the cases' UTF-8 bytes (one core)."""
    t0 = time.perf_counter()
    found = [check(c[0]) for c in cases]
    return found, round(sum(len(c[0].encode()) for c in cases) / 1e6 / (time.perf_counter() - t0), 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--per-kind", type=int, default=200)
    p.add_argument("--carriers", type=int, default=1500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-baseline", action="store_true", help="skip datatrove (its index takes ~10 minutes)")
    args = p.parse_args()
    cfg = configs.load(args.config)
    d, n = cfg.decontaminate, cfg.decontaminate.ngram
    rng = random.Random(args.seed)
    items = {b.name: [t for _, t in contamination.items(b)] for b in cfg.benchmarks}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        built = contamination.build_index(cfg.benchmarks, d, Path(tmp))
        figures = {"config": cfg.name, "ngram": n, "edited_ngram": d.edited_ngram, "benchmarks": len(cfg.benchmarks),
                   "items": sum(len(v) for v in items.values()), "ngrams_indexed": built["ngrams"],
                   "index_build_s": round(time.perf_counter() - t0, 1)}
        index = contamination.Index(Path(tmp))
        systems = {"moeflow": lambda text: index.find(text, d)}
        if not args.no_baseline:
            t0 = time.perf_counter()
            systems["datatrove"] = Datatrove(items, n, Path(tmp)).flags
            figures["datatrove_index_build_s"] = round(time.perf_counter() - t0, 1)
        docs = carriers(args.carriers)
        # carriers either system flags unplanted share n-grams with items they predate: `quoted` negatives;
        # the others (`carrier` negatives) host the planted cases
        either = [any(bool(check(x)) for check in systems.values()) for x in docs]
        flagged = [x for x, f in zip(docs, either) if f]
        clean = [x for x, f in zip(docs, either) if not f]
        cases = cases_for(items, clean, flagged, n, d.max_items_per_ngram, rng, args.per_kind)
        figures |= {"cases": len(cases), "positives": sum(c[1] for c in cases),
                    "positives_intact": sum(c[1] and c[3] for c in cases), "negatives": sum(not c[1] for c in cases)}
        for name, check in systems.items():
            found, mb_s = timed(check, cases)
            figures[name] = {**tally(cases, [bool(f) for f in found]), "mb_per_s": mb_s}
            if name == "moeflow":
                figures[name]["flagged_by_tier"] = tiers(cases, found)
    for name in systems:
        r = figures[name]
        print(f"{name:9} precision {r['precision']}  recall {r['recall']}  recall on intact cases "
              f"{r['recall_intact']}  own kinds {r['recall_own_kinds']}  {r['mb_per_s']} MB/s")
        print("          " + ", ".join(f"{k} {v}" for k, v in r["flagged_by_kind"].items()))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
