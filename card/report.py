"""The lineage report: each artifact's record as Markdown, the artifact graph as SVG, both as one HTML page."""

from __future__ import annotations

import json
from pathlib import Path

from moeflow.card.graph import artifact_name, last_run, single, upstream
from moeflow.card.plots import PLOTS, WATERFALL, waterfall
from moeflow.card.sections import table

REPORT, HTML, DAG = "lineage_report.md", "lineage_report.html", "lineage.svg"


def _flat(obj, prefix: str = "") -> dict[str, object]:
    if isinstance(obj, (dict, list)):
        out: dict[str, object] = {}
        for k, v in obj.items() if isinstance(obj, dict) else enumerate(obj):
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def _short(value: object, width: int = 60) -> str:
    text = json.dumps(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def config_diff(rec: dict) -> tuple[str | None, list[str]]:
    """(previous artifact, changed config fields) against `rec["previous"]`: the latest other artifact
    of the same stage that had finished when this one started, recorded then (later runs change nothing)."""
    prev = rec.get("previous")
    if not prev:
        return None, []
    a, b = _flat(prev["config"]), _flat(rec["config"])
    changes = [
        f"`{k}`: {_short(a.get(k))} → {_short(b.get(k))}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]
    if len(changes) > 8:
        changes = changes[:8] + [f"and {len(changes) - 8} more"]
    return prev["artifact"], changes


def drill_down(graph: dict[str, dict], per_shard: int = 3) -> list[str]:
    """Token shards -> their first documents -> the raw files they came from, as the tokenize record says."""
    tok = single(graph, "tokenize", required=False)
    if tok is None:
        return []
    out = ["## Drill-down: token shards → documents → raw files", ""]
    if "by_shard" not in tok["stats"]:
        return out + [f"`{artifact_name(tok['artifact'])}` recorded no per-shard detail.", ""]
    for s in tok["stats"]["by_shard"]:
        sources = ", ".join(f"{k} {v}" for k, v in sorted(s["sources"].items()))
        out += [
            f"- `{artifact_name(tok['artifact'])}/shard-{s['shard']:05d}.arrow`: {s['documents']} documents, "
            f"{s['tokens']:,} tokens ({sources})"
        ]
        out += [
            f"  - row {r['row']}: `{r['doc_id']}` ({r['tokens']} tokens) from `{r['path']}`"
            for r in s["first_rows"][:per_shard]
        ]
    return out + ["", "`moeflow explain DOC_ID` follows any document through every stage.", ""]


SVG_STYLE = {True: 'fill="#e3f4e6" stroke="#2e7d32"',  # rebuilt by the last run
             False: 'fill="#f2f2f2" stroke="#8a8a8a" stroke-dasharray="4 3"'}  # reused


def dag_svg(graph: dict[str, dict]) -> str:
    """The artifact graph as a standalone SVG: a box per artifact (stage, hash, and whether the last run
    built or reused it), a column per depth (longest path from a source), an arrow per artifact read."""
    from html import escape

    run, built = last_run(graph)

    ups = {n: upstream(graph, r) for n, r in graph.items()}
    depth: dict[str, int] = {}
    for n in graph:  # `graph` is in topological order
        depth[n] = 1 + max((depth[u] for u in ups[n]), default=-1)
    columns: dict[int, list[str]] = {}
    for n in graph:
        columns.setdefault(depth[n], []).append(n)
    w, h, dx, dy, pad = 130, 46, 170, 62, 10
    pos = {n: (pad + d * dx, pad + i * dy) for d, names in columns.items() for i, n in enumerate(names)}
    width = pad * 2 + max(columns) * dx + w
    height = pad * 2 + max(len(v) for v in columns.values()) * dy - (dy - h) + 30
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="11"><defs><marker id="a" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" '
        'markerHeight="6" orient="auto"><path d="M0,0L10,5L0,10z" fill="#555"/></marker></defs>'
    ]
    for n in graph:
        for u in ups[n]:
            (x0, y0), (x1, y1) = pos[u], pos[n]
            x0, y0, y1 = x0 + w, y0 + h / 2, y1 + h / 2
            parts.append(
                f'<path d="M{x0},{y0} C{x0 + 30},{y0} {x1 - 30},{y1} {x1},{y1}" fill="none" stroke="#555" '
                'marker-end="url(#a)"/>'
            )
    for n, (x, y) in pos.items():
        parts.append(
            f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="4" {SVG_STYLE[n in built or not run]}/>'
            f'<text x="{x + w / 2}" y="{y + 14}" text-anchor="middle" font-weight="bold">'
            f"{escape(graph[n]['stage'])}</text>"
            f'<text x="{x + w / 2}" y="{y + 27}" text-anchor="middle" fill="#555">'
            f"{escape(graph[n]['artifact']['hash'][:12])}</text>"
            f'<text x="{x + w / 2}" y="{y + 40}" text-anchor="middle" fill="#555" font-style="italic">'
            f"{('rebuilt' if n in built else 'reused') if run else ''}</text>"
        )
    legend = f"last run: flow run {run}" if run else "no Prefect flow run recorded"
    parts.append(
        f'<g transform="translate({pad},{height - 18})"><rect width="12" height="12" {SVG_STYLE[True]}/>'
        f'<text x="16" y="10">rebuilt by the last run</text><rect x="170" width="12" height="12" '
        f'{SVG_STYLE[False]}/><text x="186" y="10">reused from an earlier run</text>'
        f'<text x="370" y="10" fill="#555">({escape(legend)})</text></g>'
    )
    return "\n".join(parts + ["</svg>", ""])


def render_report(graph: dict[str, dict]) -> str:
    """Every artifact's config, inputs, code, run and stats, upstream first, then the drill-down."""
    run, built = last_run(graph)
    out = [
        "# Lineage report",
        "",
        f"![artifact graph: a box per stage, its artifact hash, and whether the last run rebuilt it]({DAG})",
        "",
        f"Last run (flow run `{run}`): {len(built)} artifact(s) rebuilt, {len(graph) - len(built)} reused "
        "from earlier runs." if run else "No Prefect flow run is recorded for these artifacts.",
        "",
        "Artifacts, upstream first: " + " → ".join(graph),
        "",
    ]
    for name, r in graph.items():
        st = r["stage"]
        by = r["prefect"].get("flow_run_id")
        fate = "rebuilt" if name in built else f"reused (built by flow run `{by}`)"
        prev, changes = config_diff(r)
        if st == "filter":
            out += _waterfall_section(r)
        diff = (
            f"- config against the previous `{st}` artifact `{prev}`: "
            + ("; ".join(changes) or "unchanged (its inputs or the stage's code changed)")
            if prev
            else f"- no earlier `{st}` artifact had finished when this one started"
        )
        out += [
            f"## {st}: `{name}`",
            "",
            f"- last run: {fate}",
            f"- content hash: `{r['artifact']['content_hash']}`; code `{r['code']['source_hash']}`",
            "- inputs: " + (", ".join(f"{k} = `{v['path']}`" for k, v in r["inputs"].items()) or "none"),
            f"- code: commit `{r['code']['commit']}`"
            + (" (uncommitted changes)" if r["code"].get("dirty") else ""),
            "- Prefect: "
            + (", ".join(f"{k} `{v}`" for k, v in sorted(r["prefect"].items())) or "not run by Prefect"),
            f"- ran {r['started_at']} to {r['finished_at']} ({r['seconds']} s) on {r['host']['hostname']}",
            diff,
            "",
            "config:",
            "",
            "```json",
            json.dumps(r["config"], indent=2, sort_keys=True),
            "```",
            "",
            "stats:",
            "",
            "```json",
            json.dumps(r["stats"], indent=2, sort_keys=True),
            "```",
            "",
        ]
    return "\n".join(out + drill_down(graph))


def _waterfall_section(rec: dict) -> list[str]:
    """The filter's documents per source and step, as a chart (`plots/filter_waterfall.png`) and a table."""
    rows = waterfall(rec["stats"], list(rec["config"].get("steps", [])))
    if not rows:
        return []
    steps = [s for s, _, _ in next(iter(rows.values()))]
    cells = [[src, *(f"{left} (-{rm})" if rm else str(left) for _, rm, left in series)]
             for src, series in rows.items()]
    grid = table(["source", *steps], cells)
    return ["## Filter waterfall", "", f"![filter waterfall](plots/{WATERFALL})", "",
            "Documents left per source after each filter step, in the order the steps ran (-n: removed by "
            "that step; a document is counted at the first step that rejects it). Tokens are not counted "
            "here: filtering runs before tokenization.", "", grid, ""]


def render_html(card_md: str, report_md: str, plots_dir: Path) -> str:
    """One self-contained HTML page (card, then report); plots inlined as data URIs, nothing fetched."""
    import base64

    import markdown

    body = card_md.split("---", 2)[2] if card_md.startswith("---") else card_md
    for name in PLOTS:
        data = base64.b64encode((plots_dir / name).read_bytes()).decode()
        body = body.replace(f"(plots/{name})", f"(data:image/png;base64,{data})")
    if (plots_dir / WATERFALL).exists():
        data = base64.b64encode((plots_dir / WATERFALL).read_bytes()).decode()
        report_md = report_md.replace(f"(plots/{WATERFALL})", f"(data:image/png;base64,{data})")
    dag = plots_dir.parent / DAG
    if dag.exists():
        report_md = report_md.replace(
            f"({DAG})", f"(data:image/svg+xml;base64,{base64.b64encode(dag.read_bytes()).decode()})"
        )
    html = markdown.markdown(body + "\n\n" + report_md, extensions=["tables", "fenced_code"])
    style = (
        "body{font-family:sans-serif;max-width:60em;margin:2em auto;padding:0 1em}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;font-size:90%}"
        "pre{background:#f6f6f6;padding:.5em;overflow-x:auto}img{max-width:100%}"
    )
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>moeflow lineage report</title>'
        f"<style>{style}</style></head><body>\n{html}\n</body></html>\n"
    )
