"""Contamination checker harness: planted benchmark items in real documents, precision, recall, throughput.

Run: `python benchmarks/contamination.py [--config tiny] [--positives N] [--seed S]` after `moeflow fetch`.
It builds the n-gram index over every benchmark of the config (timed), takes real documents from
the fetched corpora as carriers, and sets aside those the index already flags (natural overlap,
counted). Into clean carriers it plants, each with a random perturbation (case, whitespace,
punctuation): whole items; fragments of two or more consecutive sentences of an item, at a
paragraph break; the same fragments embedded mid-paragraph. Hard negatives are clean carriers with
three spans of 8-12 words copied from different items (common benchmark phrasing, below the n-gram
length). Precision and recall count documents; throughput is the check over the clean carriers on
one core against the full index. The last line printed is one JSON object.
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

from moeflow import configs
from moeflow.dedup import contamination
from moeflow.sources import fetch

SENTENCE = re.compile(r"(?<=[.!?])\s+")


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


def perturb(text: str, rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["case", "whitespace", "punctuation", "none"])
    if kind == "case":
        text = text.upper() if rng.random() < 0.5 else text.title()
    elif kind == "whitespace":
        text = re.sub(r"\s+", lambda m: rng.choice([" ", "  ", "\n", " \n "]), text)
    elif kind == "punctuation":
        text = re.sub(r"[,.;:!?\"']", lambda m: rng.choice(["", " ", ";", "--"]), text)
    return text, kind


def plant(carrier: str, insert: str, rng: random.Random, embedded: bool) -> str:
    if embedded:  # mid-paragraph: inside a line, between two words
        spaces = [m.start() for m in re.finditer(" ", carrier)] or [len(carrier) // 2]
        at = rng.choice(spaces)
        return carrier[:at] + " " + insert + " " + carrier[at:]
    breaks = [m.end() for m in re.finditer(r"\n\s*\n", carrier)] or [len(carrier)]
    at = rng.choice(breaks)
    return carrier[:at] + insert + "\n\n" + carrier[at:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--positives", type=int, default=600)
    p.add_argument("--carriers", type=int, default=1500)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    cfg = configs.load(args.config)
    n = cfg.decontaminate.ngram
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        built = contamination.build_index(cfg.benchmarks, cfg.decontaminate, Path(tmp))
        build_s = time.perf_counter() - t0
        index = contamination.Index(Path(tmp))
    items = {b.name: list(contamination.items(b)) for b in cfg.benchmarks}

    docs = carriers(args.carriers)
    t0 = time.perf_counter()
    flags = [index.matches(d, n)[0] >= cfg.decontaminate.min_matches for d in docs]
    check_s = time.perf_counter() - t0
    mb = sum(len(d.encode()) for d in docs) / 1e6
    clean = [d for d, f in zip(docs, flags) if not f]

    cases = []  # (text, is_positive, kind, words planted)
    for i in range(args.positives):
        bench = rng.choice(sorted(items))
        _, text = rng.choice(items[bench])
        kind = ("whole", "fragment", "embedded")[i % 3]
        if kind != "whole":
            sentences = [s for s in SENTENCE.split(text.replace("\n", " ")) if s.strip()]
            if len(sentences) < 2:
                kind, insert = "whole", text
            else:
                k = rng.randint(2, min(4, len(sentences)))
                start = rng.randrange(len(sentences) - k + 1)
                insert = " ".join(sentences[start : start + k])
        else:
            insert = text
        insert, how = perturb(insert, rng)
        words = len(contamination.words(insert))
        cases.append(
            (plant(rng.choice(clean), insert, rng, kind == "embedded"), True, f"{kind}/{how}", words)
        )
    for _ in range(args.positives):
        spans = []
        for bench in rng.sample(sorted(items), 3):
            w = contamination.words(rng.choice(items[bench])[1])
            k = rng.randint(8, min(12, n - 1))
            if len(w) > k:
                s = rng.randrange(len(w) - k)
                spans.append(" ".join(w[s : s + k]))
        doc = rng.choice(clean)
        for span in spans:
            doc = plant(doc, span, rng, embedded=True)
        cases.append((doc, False, "hard_negative", 0))
    cases += [(d, False, "clean", 0) for d in clean]

    tp = fp = fn = 0
    by_kind: dict[str, list[int]] = {}
    for text, positive, kind, words in cases:
        hit = index.matches(text, n)[0] >= cfg.decontaminate.min_matches
        tp, fp, fn = tp + (hit and positive), fp + (hit and not positive), fn + (positive and not hit)
        key = kind.split("/")[0] + ("" if not positive or words >= n else "_shorter_than_n")
        by_kind.setdefault(key, [0, 0])
        by_kind[key][0] += hit
        by_kind[key][1] += 1
    multi = [c for c in cases if c[1] and c[2].split("/")[0] in ("fragment", "embedded")]
    multi_long = [c for c in multi if c[3] >= n]
    hit_of = lambda c: index.matches(c[0], n)[0] >= cfg.decontaminate.min_matches  # noqa: E731
    hits_long = sum(map(hit_of, multi_long))
    hits_multi = hits_long + sum(map(hit_of, [c for c in multi if c[3] < n]))
    figures = {
        "config": cfg.name,
        "ngram": n,
        "benchmarks": len(cfg.benchmarks),
        "items": sum(len(v) for v in items.values()),
        "ngrams_indexed": built["ngrams"],
        "index_build_s": round(build_s, 1),
        "carriers": len(docs),
        "carriers_flagged_before_planting": len(docs) - len(clean),
        "planted_positives": sum(c[1] for c in cases),
        "negatives": sum(not c[1] for c in cases),
        "precision": round(tp / max(1, tp + fp), 4),
        "recall": round(tp / max(1, tp + fn), 4),
        "recall_multi_sentence": round(hits_multi / max(1, len(multi)), 4),
        "recall_multi_sentence_at_least_n_words": round(hits_long / max(1, len(multi_long)), 4),
        "multi_sentence_fragments_shorter_than_n_words": len(multi) - len(multi_long),
        "detected_by_kind": {k: f"{h}/{t}" for k, (h, t) in sorted(by_kind.items())},
        "check_mb": round(mb, 1),
        "check_mb_per_s_per_core": round(mb / check_s, 2),
    }
    print(
        f"precision {figures['precision']}, recall {figures['recall']} (multi-sentence fragments: "
        f"{figures['recall_multi_sentence']}; those of >= {n} words: "
        f"{figures['recall_multi_sentence_at_least_n_words']}); "
        f"check {figures['check_mb_per_s_per_core']} MB/s on one core; index of {built['ngrams']:,} n-grams "
        f"built in {figures['index_build_s']} s"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
