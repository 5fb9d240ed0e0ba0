"""The stages this package declares: `quality_model` (train or take a fastText classifier) and `quality` (score
every document, keep the best; record-sharded)."""

from __future__ import annotations

from moeflow.core.stage import Phase, Stage
from moeflow.quality import classifier, score


def _shards(c, inputs) -> int:
    return c.quality.shards or c.execution.shards


LIBRARIES = ("fasttext-numpy2-wheel", "numpy")
QUALITY_MODEL = Stage("quality_model", classifier.config, classifier.stage, LIBRARIES, fetched=classifier.fetched,
                      section="quality")
QUALITY = Stage(
    "quality",
    lambda c: c.quality,
    None,
    (*LIBRARIES, "pyarrow"),
    reads="docs",
    phases=(
        Phase("score", score.score_part, _shards),
        Phase("cutoffs", score.cutoffs_part, lambda c, inputs: 1),
        Phase("keep", score.keep_part, _shards),
    ),
    merge=score.merge,
    section="quality",
)
