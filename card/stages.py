"""The stage this package declares: `card`, from the lineage records alone (its body imports matplotlib, so it
is named, not imported)."""

from __future__ import annotations

from moeflow.core.stage import Lazy, Stage

CARD = Stage("card", lambda c: {}, Lazy("moeflow.card.publish:stage"), ("huggingface_hub", "matplotlib", "markdown"))
