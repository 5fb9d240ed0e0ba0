"""The model card and lineage report, generated from the `lineage.json` records walked back from an artifact.

`generate(start, out)` (`card/generate.py`) writes `README.md` (a Hugging Face model card with YAML
metadata, `card/model_card.py`), the corpus's `dataset_card.md` (`card/dataset.py`), `lineage_report.md`, a
self-contained `lineage_report.html` and the artifact graph `lineage.svg` (`card/report.py`), and the health
plots under `plots/` (`card/plots.py`). Each document is a Jinja2 template in `card/templates/` (headings,
prose, the order of sections) filled by small builders that read the lineage graph and make the tables.
Nothing is read but those lineage records (`card/graph.py` walks them; the config diff and the drill-down are
in them, written when the stages ran) and, for the plots, the metrics of the train artifact they name: other
artifacts in the store never change a byte, and `moeflow card ARTIFACT_DIR` rebuilds the same bytes.
"""

from moeflow.card import plots
from moeflow.card.generate import generate
from moeflow.card.graph import by_stage, collect, last_run, single, upstream
from moeflow.card.graph import upstream as _upstream  # the name tests/test_flow.py reads
from moeflow.card.model_card import CARD, render_card
from moeflow.card.report import DAG, HTML, REPORT, config_diff, dag_svg, drill_down, render_html, render_report
from moeflow.card.sections import RUN_RECORD

__all__ = [
    "CARD", "DAG", "HTML", "REPORT", "RUN_RECORD", "_upstream", "by_stage", "collect", "config_diff", "dag_svg",
    "drill_down", "generate", "last_run", "plots", "render_card", "render_html", "render_report", "single",
    "upstream",
]
