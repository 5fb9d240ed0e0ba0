"""The `quality` stage: score every document with the classifier and keep the best, in three phases.

`score` (record shards): each document's score, P(high quality) from `quality_model`, its coherence
(`coherence.py`) and its grammar (`grammar.py`), both on the whole text, into `scores.parquet`.
`cutoffs` (one part): for each `top_fraction` group (a source, a domain or the corpus, as `quality.overrides`
say) the last document kept, ranking by score, then id; and a domain the rules would empty fails here,
before any document is written. `keep` (record shards): documents at or above their rule stay; the rest are
`dropped` with reason `quality.below_threshold` and the score in the detail, or, whatever their score, with
`quality.incoherent` when their coherence is below `quality_model`'s threshold, or `quality.ungrammatical`
when their grammar is not above its own (value and threshold in the detail; every ledger row carries its
score). `top_fraction` ranks all documents by score; those the two rules drop go on top. `merge` joins the
shards in rank order, so the output is the same for any shard count, and records per domain the five
documents kept with the lowest scores and the five dropped with the highest (review).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moeflow.configs import QualityConfig
from moeflow.core.documents import DocWriter, iter_docs, join
from moeflow.core.ledger import Ledger
from moeflow.core.ledger import read as read_ledger
from moeflow.core.progress import tqdm
from moeflow.quality import coherence, grammar
from moeflow.quality.classifier import MODEL, QualityError, hq_label, line, load, scores

SCORES = "scores.parquet"
CUTOFFS = "cutoffs.json"
SCHEMA = pa.schema([("id", pa.string()), ("domain", pa.string()), ("source", pa.string()),
                    ("score", pa.float64()), ("coherence", pa.float64()), ("grammar", pa.float64())])
ROWS_PER_GROUP = 65_536  # fixed, so the joined scores have the same bytes for any shard count
BINS = 20  # the per-domain score histogram: [0, 0.05), ..., [0.95, 1]
BATCH = 512


class Rules:
    """A model folder's rules beside the score: coherence and grammar, each a value per document and the
    reason it drops one for."""

    def __init__(self, model_dir: Path):
        self.coherence, self.grammar = coherence.Judge(model_dir), grammar.Judge(model_dir)

    def values(self, text: str) -> tuple[float, float]:
        """(coherence, grammar) of a document, its words read once."""
        ws = coherence.words(text) if self.coherence.threshold > 0 or self.grammar.threshold is not None else []
        return self.coherence.value(ws), self.grammar.value(ws)

    def failed(self, scored: dict) -> tuple[str, dict] | None:
        """(reason, detail) of the rule a scored row (its `coherence` and `grammar`) fails, or None."""
        if not self.coherence.passes(scored["coherence"]):
            return "quality.incoherent", {"coherence": scored["coherence"], "threshold": self.coherence.threshold}
        if not self.grammar.passes(scored["grammar"]):
            return "quality.ungrammatical", {"grammar": scored["grammar"], "threshold": self.grammar.threshold}
        return None


def score_part(cfg: QualityConfig, inputs: dict, prior: dict, out: Path, part: tuple[int, int]) -> dict:
    """Score one record shard of the documents into `scores.parquet`."""
    model_dir = inputs["model"].dir
    label = inputs["model"].stats["label"]
    model = load(str(model_dir / MODEL))
    hq_label(model, label)
    rules = Rules(model_dir)
    rows: dict[str, list] = {name: [] for name in SCHEMA.names}
    batch: list[str] = []

    def flush() -> None:
        rows["score"].extend(scores(model, label, batch).tolist())
        batch.clear()

    docs = iter_docs(inputs["docs"].dir, columns=["id", "domain", "source", "text"], shard=part)
    for row in tqdm(docs, desc=f"quality score {part[0]}/{part[1]}", unit="doc", mininterval=5):
        for name in ("id", "domain", "source"):
            rows[name].append(row[name])
        coherent, grammatical = rules.values(row["text"])
        rows["coherence"].append(coherent)
        rows["grammar"].append(grammatical)
        batch.append(line(row["text"], cfg.train.max_chars))
        if len(batch) == BATCH:
            flush()
    flush()
    pq.write_table(pa.table(rows, schema=SCHEMA), out / SCORES, row_group_size=ROWS_PER_GROUP,
                   compression="zstd")
    return {"documents": len(rows["id"])}


def cutoffs_part(cfg: QualityConfig, inputs: dict, prior: dict, out: Path, part: tuple[int, int]) -> dict:
    """Each `top_fraction` group's last kept (score, id); fails when the rules would leave a domain empty."""
    table = pa.concat_tables([pq.read_table(p / SCORES) for p in prior["score"]]).combine_chunks()
    ids = np.asarray(table.column("id").to_pylist(), dtype=object)
    score = table.column("score").to_numpy()
    domains, sources = table.column("domain").to_pylist(), table.column("source").to_pylist()
    rules = Rules(inputs["model"].dir)
    coherent = [rules.failed(r) is None for r in table.select(["coherence", "grammar"]).to_pylist()]
    groups = np.asarray([cfg.group(d, s) for d, s in zip(domains, sources, strict=True)], dtype=object)
    cuts: dict[str, list] = {}
    for group in sorted(set(groups.tolist())):
        mine = np.flatnonzero(groups == group)
        first = mine[0]
        rule = cfg.rule(domains[first], sources[first])
        if rule.top_fraction is None:
            continue
        k = max(1, math.ceil(rule.top_fraction * len(mine)))
        order = sorted(mine.tolist(), key=lambda i: (-score[i], ids[i]))
        cuts[group] = [float(score[order[k - 1]]), str(ids[order[k - 1]])]
    kept = Counter(d for d, s, i, x, c in zip(domains, sources, ids, score, coherent, strict=True)
                   if c and keeps(cfg, cuts, d, s, i, x))
    empty = sorted(set(domains) - set(kept))
    if empty:
        raise QualityError(
            f"quality would drop every document of domain(s) {empty}: lower quality.keep (or set "
            f"quality.overrides.{empty[0]}: {{threshold: ...}} or {{top_fraction: ...}}), or give that domain "
            "no mix weight and no sources")
    (out / CUTOFFS).write_text(json.dumps(cuts, sort_keys=True))
    return {"cutoffs": cuts}


def keeps(cfg: QualityConfig, cuts: dict, domain: str, source: str, doc_id: str, score: float) -> bool:
    rule = cfg.rule(domain, source)
    if rule.threshold is not None:
        return score >= rule.threshold
    cut_score, cut_id = cuts[cfg.group(domain, source)]
    return score > cut_score or (score == cut_score and doc_id <= cut_id)


def _detail(cfg: QualityConfig, cuts: dict, domain: str, source: str, score: float) -> str:
    rule = cfg.rule(domain, source)
    if rule.threshold is not None:
        return json.dumps({"score": score, "threshold": rule.threshold})
    cut = cuts[cfg.group(domain, source)][0]
    return json.dumps({"score": score, "top_fraction": rule.top_fraction, "cutoff": cut})


def keep_part(cfg: QualityConfig, inputs: dict, prior: dict, out: Path, part: tuple[int, int]) -> dict:
    """Keep one record shard's documents by their rule; every ledger row has the document's score."""
    cuts = json.loads((prior["cutoffs"][0] / CUTOFFS).read_text())
    mine = pq.read_table(prior["score"][part[0]] / SCORES, columns=["score", "coherence", "grammar"]).to_pylist()
    rules = Rules(inputs["model"].dir)
    ledger = Ledger("quality", out)
    by_domain: dict[str, dict] = {}
    by_source: dict[str, Counter] = {}  # kept and dropped:<reason>, as the filter counts them (the waterfall)
    n_in = 0
    with DocWriter(out) as writer:
        for row, scored in zip(iter_docs(inputs["docs"].dir, shard=part), mine, strict=True):
            n_in += 1
            score = scored["score"]
            d = by_domain.setdefault(row["domain"], {"documents": 0, "kept": 0, "histogram": [0] * BINS})
            d["documents"] += 1
            d["histogram"][min(int(score * BINS), BINS - 1)] += 1
            counts = by_source.setdefault(row["source"], Counter())
            failed = rules.failed(scored)
            if failed:
                ledger.add(row["id"], "dropped", failed[0], json.dumps({"score": score} | failed[1]))
                counts[f"dropped:{failed[0]}"] += 1
            elif keeps(cfg, cuts, row["domain"], row["source"], row["id"], score):
                ledger.add(row["id"], "kept", "", json.dumps({"score": score}))
                writer.write(row)
                d["kept"] += 1
                counts["kept"] += 1
            else:
                ledger.add(row["id"], "dropped", "quality.below_threshold",
                           _detail(cfg, cuts, row["domain"], row["source"], score))
                counts["dropped:quality.below_threshold"] += 1
        n_out = writer.count
    ledger.write()
    return {**ledger.check(n_in, n_out), "by_domain": dict(sorted(by_domain.items())),
            "by_source": {s: dict(sorted(c.items())) for s, c in sorted(by_source.items())}}


def merge(cfg: QualityConfig, prior: dict[str, list[Path]], out: Path) -> dict:
    """Join the shards in rank order: documents, ledgers, scores, and the per-domain counts and histograms."""
    parts = prior["keep"]
    by_domain: dict[str, dict] = {}
    by_source: dict[str, Counter] = {}
    for p in parts:
        stats = json.loads((p / "manifest.json").read_text())["stats"]
        for source, counts in stats["by_source"].items():
            by_source.setdefault(source, Counter()).update(counts)
        for domain, d in stats["by_domain"].items():
            acc = by_domain.setdefault(domain, {"documents": 0, "kept": 0, "histogram": [0] * BINS})
            acc["documents"] += d["documents"]
            acc["kept"] += d["kept"]
            acc["histogram"] = [a + b for a, b in zip(acc["histogram"], d["histogram"], strict=True)]
    table = pa.concat_tables([pq.read_table(p / SCORES) for p in prior["score"]]).combine_chunks()
    pq.write_table(table, out / SCORES, row_group_size=ROWS_PER_GROUP, compression="zstd")
    cuts = json.loads((prior["cutoffs"][0] / CUTOFFS).read_text())
    joined = join(parts, out, "quality")
    for domain, examples in borderline(table, read_ledger(out).column("fate").to_pylist()).items():
        by_domain[domain]["borderline"] = examples
    return {**joined, "by_domain": dict(sorted(by_domain.items())), "cutoffs": cuts, "shards": len(parts),
            "by_source": {s: dict(sorted(c.items())) for s, c in sorted(by_source.items())}}


def borderline(scores: pa.Table, fates: list[str], n: int = 5) -> dict[str, dict]:
    """Per domain, for review: the `n` kept documents scoring lowest and the `n` dropped scoring highest,
    [id, score] from the line outward (ties by id)."""
    out: dict[str, dict] = {}
    rows = zip(scores.column("id").to_pylist(), scores.column("domain").to_pylist(),
               scores.column("score").to_pylist(), fates, strict=True)
    for doc_id, domain, score, fate in rows:
        side = out.setdefault(domain, {"above": [], "below": []})["above" if fate == "kept" else "below"]
        side.append([doc_id, score])
    for sides in out.values():
        sides["above"] = sorted(sides["above"], key=lambda r: (r[1], r[0]))[:n]
        sides["below"] = sorted(sides["below"], key=lambda r: (-r[1], r[0]))[:n]
    return out
