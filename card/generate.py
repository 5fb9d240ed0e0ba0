"""`generate`: every file of a card (model card, dataset card, report, graph, plots) from lineage alone."""

from __future__ import annotations

import json
from pathlib import Path

from moeflow.card import plots
from moeflow.card.dataset import DATASET_CARD
from moeflow.card.dataset import render as render_dataset_card
from moeflow.card.graph import artifact_name, collect, single
from moeflow.card.model_card import CARD, render_card
from moeflow.card.report import DAG, HTML, REPORT, dag_svg, render_html, render_report


def generate(start: Path | list[Path], out: Path, export: dict | None = None) -> dict:
    """Write the card, the dataset card, the report and the plots for the artifact(s) at `start`.

    A card artifact at `start` stands for its inputs. `export`: the stats of an export being written (its
    card is written into it before its lineage record exists).
    """
    roots = [Path(p).resolve() for p in (start if isinstance(start, list) else [start])]
    if len(roots) == 1 and (roots[0] / "lineage.json").exists():
        rec = json.loads((roots[0] / "lineage.json").read_text())
        if rec["stage"] == "card":
            roots = [roots[0].parent.parent / inp["path"] for _, inp in sorted(rec["inputs"].items())]
    graph = collect(roots)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train = single(graph, "train")
    metrics = roots[0].parent.parent / "train" / artifact_name(train["artifact"]) / "metrics.jsonl"
    plots.health(metrics, train["config"]["train"], out / "plots")
    fil, quality = single(graph, "filter"), single(graph, "quality", required=False)
    plots.filter_waterfall(plots.waterfall(fil["stats"], list(fil["config"].get("steps", [])),
                                           quality and quality["stats"]), out / "plots" / plots.WATERFALL)
    if quality is not None:
        plots.quality_histograms(quality["stats"], quality["config"], out / "plots" / plots.QUALITY)
    card_md, report_md = render_card(graph, export), render_report(graph)
    (out / CARD).write_text(card_md)
    (out / DATASET_CARD).write_text(render_dataset_card(graph))
    (out / REPORT).write_text(report_md)
    (out / DAG).write_text(dag_svg(graph))
    (out / HTML).write_text(render_html(card_md, report_md, out / "plots"))
    return {
        "artifacts": list(graph),
        "card": CARD,
        "dataset_card": DATASET_CARD,
        "report": REPORT,
        "html": HTML,
        "dag": DAG,
        "plots": list(plots.PLOTS),
    }
