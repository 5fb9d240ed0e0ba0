"""Model-based quality filtering: a fastText classifier (`classifier.py`) scores every document and the best are
kept (`score.py`)."""

from moeflow.quality.classifier import MIN_POSITIVES, QualityError, preflight

__all__ = ["MIN_POSITIVES", "QualityError", "preflight"]
