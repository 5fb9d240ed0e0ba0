"""The `card` stage's body: generate the card from lineage, show it on the flow run as Prefect artifacts."""

from __future__ import annotations

from pathlib import Path

from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.context import FlowRunContext

from moeflow.card.dataset import DATASET_CARD
from moeflow.card.generate import generate
from moeflow.card.graph import collect
from moeflow.card.model_card import CARD


def stage(s: dict, inputs: dict, out: Path) -> dict:
    """Walk the lineage back from every input (evaluate, overlap, model, sources) and write the card there."""
    roots = [m.dir for _, m in sorted(inputs.items())]
    stats = generate(roots, out)
    _publish(out, roots)
    return stats


def _publish(out: Path, roots: list[Path]) -> None:
    """Put the card and the per-stage figures on the flow run as Prefect artifacts (visible in the UI)."""
    if FlowRunContext.get() is None:
        return
    create_markdown_artifact(
        key="model-card", markdown=(out / CARD).read_text(), description="moeflow model card"
    )
    create_markdown_artifact(key="dataset-card", markdown=(out / DATASET_CARD).read_text(),
                             description="moeflow dataset card of the curated corpus")
    rows = [
        {
            "stage": rec["stage"],
            "artifact": f"{rec['stage']}-{rec['artifact']['hash']}",
            "seconds": rec.get("wall_seconds", rec["seconds"]),
            "documents_in": rec["stats"].get("documents_in", ""),
            "documents_out": rec["stats"].get("documents_out", ""),
        }
        for rec in collect(roots).values()
    ]
    create_table_artifact(key="stage-stats", table=rows, description="moeflow stages of this run")
