"""Quality-aware mixing (`mix.quality_buckets`, Olmo 3's quality-aware upsampling): each domain's training
documents are split by their quality score into buckets, and each bucket is drawn as a domain of its own.

A bucket's share of its domain's weight is its training tokens times its `repeat`, over the domain's sum of
those: with repeats 2 and 1, a token of the better bucket is drawn twice as often as one of the other. The mix
then checks each bucket's epochs against `mix.max_epochs` as it does a domain's, and its stats (and the
model card's mix tables) hold each bucket by its label, `domain@min_score`.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from moeflow.configs import MixConfig, Phase
from moeflow.quality.score import SCORES


def label(domain: str, min_score: float) -> str:
    """A bucket's name in the mix: its domain and the lowest score it holds."""
    return f"{domain}@{min_score:g}"


def read_scores(quality_dir: Path) -> dict[str, float]:
    """Document id -> quality score, from the `quality` stage's artifact."""
    table = pq.read_table(Path(quality_dir) / SCORES, columns=["id", "score"])
    return dict(zip(table.column("id").to_pylist(), table.column("score").to_pylist(), strict=True))


def split(cfg: MixConfig, train: dict[str, list[str]], scores: dict[str, float] | None, length: dict[str, int],
          phases: list[Phase]) -> tuple[dict[str, list[str]], list[Phase], dict[str, str]]:
    """(bucket label -> its training ids in their order, the phases with each domain's weight spread over its
    buckets, document id -> bucket label); without `cfg.quality_buckets` all as given."""
    if not cfg.quality_buckets:
        return train, phases, {}
    if scores is None:
        raise ValueError("mix.quality_buckets needs the quality stage's scores: the mix was given none")
    top_first = sorted(cfg.quality_buckets, key=lambda b: -b.min_score)
    out: dict[str, list[str]] = {}
    share: dict[str, dict[str, float]] = {}  # domain -> {its bucket's label: tokens x repeat}
    for domain, ids in sorted(train.items()):
        mine: dict[str, list[str]] = {}
        repeat = {}
        for doc_id in ids:
            if doc_id not in scores:
                raise ValueError(f"mix.quality_buckets: document {doc_id!r} has no quality score; the mix's "
                                 "documents must come through the quality stage")
            bucket = next(b for b in top_first if scores[doc_id] >= b.min_score)
            name = label(domain, bucket.min_score)
            mine.setdefault(name, []).append(doc_id)
            repeat[name] = bucket.repeat
        out |= mine
        share[domain] = {name: repeat[name] * sum(length[i] + 1 for i in m) for name, m in mine.items()}
    return out, [_spread(ph, share) for ph in phases], {d: name for name, ids in out.items() for d in ids}


def _spread(ph: Phase, share: dict[str, dict[str, float]]) -> Phase:
    """`ph` with each domain's weight spread over its buckets by `share` (a domain with none keeps it)."""
    weights: dict[str, float] = {}
    for domain, w in ph.weights.items():
        total = sum(share.get(domain, {}).values())
        weights |= {name: w * s / total for name, s in share[domain].items()} if total else {domain: w}
    return ph.model_copy(update={"weights": dict(sorted(weights.items()))})
