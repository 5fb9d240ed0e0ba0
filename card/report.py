"""The lineage report: each artifact's record as Markdown, the artifact graph as SVG, both as one HTML page."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import markdown

from moeflow.card.graph import artifact_name, last_run, single, upstream
from moeflow.card.plots import PLOTS, QUALITY, WATERFALL, quality_line, waterfall
from moeflow.card.render import render
from moeflow.card.sections import seconds, table

REPORT, HTML, DAG = "lineage_report.md", "lineage_report.html", "lineage.svg"
TEMPLATE, PAGE, SVG = "lineage_report.md.j2", "lineage_report.html.j2", "lineage.svg.j2"
DRILL_DOWN = "_drill_down.md.j2"  # the report's last section, also rendered alone by `drill_down`


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


def _drill(graph: dict[str, dict], per_shard: int) -> dict | None:
    """The tokenize record's shards, each with its first `per_shard` rows (None when it kept no per-shard
    detail); None without a token store."""
    tok = single(graph, "tokenize", required=False)
    if tok is None:
        return None
    if "by_shard" not in tok["stats"]:
        return {"artifact": artifact_name(tok["artifact"]), "shards": None}
    shards = [
        {"file": f"shard-{s['shard']:05d}.arrow", "documents": s["documents"], "tokens": s["tokens"],
         "sources": ", ".join(f"{k} {v}" for k, v in sorted(s["sources"].items())),
         "rows": s["first_rows"][:per_shard]}
        for s in tok["stats"]["by_shard"]
    ]
    return {"artifact": artifact_name(tok["artifact"]), "shards": shards}


def drill_down(graph: dict[str, dict], per_shard: int = 3) -> list[str]:
    """Token shards -> their first documents -> the raw files they came from, as the tokenize record says;
    the report's last section, as lines."""
    drill = _drill(graph, per_shard)
    return render(DRILL_DOWN, drill=drill).split("\n") if drill else []


def _artifact(name: str, graph: dict[str, dict], built: set[str]) -> dict:
    """One artifact's section of the report: where it came from, how it ran, its config and stats."""
    r = graph[name]
    prev, changes = config_diff(r)
    return {
        "name": name,
        "stage": r["stage"],
        "rebuilt": name in built,
        "built_by": r["prefect"].get("flow_run_id"),
        "content_hash": r["artifact"]["content_hash"],
        "source_hash": r["code"]["source_hash"],
        "inputs": ", ".join(f"{k} = `{v['path']}`" for k, v in r["inputs"].items()) or "none",
        "commit": r["code"]["commit"],
        "dirty": r["code"].get("dirty"),
        "prefect": ", ".join(f"{k} `{v}`" for k, v in sorted(r["prefect"].items())) or "not run by Prefect",
        "started_at": r["started_at"],
        "finished_at": r["finished_at"],
        "seconds": seconds(r),
        "host": r["host"]["hostname"],
        "previous": prev,
        "changes": "; ".join(changes),
        "config": json.dumps(r["config"], indent=2, sort_keys=True),
        "stats": json.dumps({k: v for k, v in r["stats"].items() if k != "review"}, indent=2, sort_keys=True),
        "waterfall": _waterfall_table(r, single(graph, "quality", required=False)) if r["stage"] == "filter" else None,
        "quality": _quality_table(r) if r["stage"] == "quality" else None,
        "classifier": _classifier(r, graph) if r["stage"] == "quality_model" else None,
    }


def _classifier(rec: dict, graph: dict[str, dict]) -> dict:
    """The quality classifier's held-out metrics (or "not measured"), and where each of its positives came from
    as its lineage records it: a registry package (version, sha256, the `sources` artifact that fetched it) or
    files on this machine."""
    s, fetched = rec["stats"], rec.get("key", {}).get("fetched", {})
    held = s.get("heldout", "not measured")
    given = fetched.get("file:quality.model")
    model = f"given: `{given['path']}` (xxh3 `{given['xxh3']}`)" if given else s["source"]
    measured = ([held] * 3 + ["-", "-"] if isinstance(held, str)
                else [held["precision"], held["recall"], held["roc_auc"], held["positives"], held["negatives"]])
    metrics = table(["classifier", "model", "label", "precision", "recall", "ROC AUC", "held-out clean",
                     "held-out junk"], [[f"`{artifact_name(rec['artifact'])}`", model, f"`{s['label']}`", *measured]])
    rows = [_positive(p, fetched, graph) for p in rec["config"].get("positives", [])]
    return {"metrics": metrics,
            "positives": table(["positive source", "files", "identity", "lineage"], rows) if rows else None}


def _positive(p: dict, fetched: dict, graph: dict[str, dict]) -> list[str]:
    """One positive source's row: what it read, the identity in the classifier's key, where that came from."""
    if not p.get("package"):
        files = fetched.get(f"local:{p['name']}") or []
        size = sum(f.get("size") or 0 for f in files)
        return [f"`{p['name']}`", f"`{p['path']}`", f"{len(files)} files, {size:,} bytes (each file's path, size "
                "and xxh3 in the key)", "read from this machine by `quality_model`"]
    ident = fetched.get(f"package:{p['package']}") or {}
    by = [artifact_name(r["artifact"]) for r in graph.values()
          if r["stage"] == "sources" and p["package"] in r["stats"].get("packages", {})]
    return [f"`{p['name']}`", f"package `{p['package']}`: `{p['path']}`",
            f"version {ident.get('version')}, sha256 `{ident.get('sha256')}`, tree `{ident.get('tree')}`"
            if ident.get("tree") else "not fetched (an optional source: skipped)",
            ("fetched by " + ", ".join(f"`{b}`" for b in by)) if by else "no `sources` artifact in this lineage"]


def _quality_table(rec: dict) -> str | None:
    """The quality stage's documents kept per domain, the domain's rule and where it cut, its scores in 20 bins
    of 0.05, and for review the five kept documents scoring lowest and the five dropped scoring highest."""
    keep, overrides = rec["config"]["keep"], rec["config"].get("overrides", {})

    def ids(rows: list) -> str:
        return "<br>".join(f"`{i}` {s:.6f}" for i, s in rows) or "none"

    rows = [[domain, d["documents"], d["kept"],
             ", ".join(f"{k} {v}" for k, v in (overrides.get(domain) or keep).items() if v is not None),
             "?" if (cut := quality_line(rec["stats"], rec["config"], domain)) is None else f"{cut:g}",
             " ".join(str(n) for n in d["histogram"]),
             ids(d.get("borderline", {}).get("above", [])), ids(d.get("borderline", {}).get("below", []))]
            for domain, d in sorted(rec["stats"].get("by_domain", {}).items())]
    return table(["domain", "documents", "kept", "rule", "keeps from", "scores: documents per 0.05, from 0 to 1",
                  "just above (kept, lowest 5)", "just below (dropped, highest 5)"], rows) if rows else None


def _waterfall_table(rec: dict, quality: dict | None) -> str | None:
    """The filter's documents left per source after each step, then dedup's and the quality stage's (the chart
    is `plots/filter_waterfall.png`)."""
    rows = waterfall(rec["stats"], list(rec["config"].get("steps", [])), quality and quality["stats"])
    if not rows:
        return None
    steps = [s for s, _, _ in next(iter(rows.values()))]
    cells = [[src, *(f"{left} (-{rm})" if rm else str(left) for _, rm, left in series)]
             for src, series in rows.items()]
    return table(["source", *steps], cells)


TIER_NAMES = {"ngram": "intact n-gram", "edited": "edited item (aligned)"}


def review(graph: dict[str, dict]) -> dict | None:
    """The decontamination review: documents flagged per tier and benchmark, and each benchmark's weakest
    flags with the item and the document window side by side (matched words in bold); None before
    decontaminate, or from a record written before the review existed."""
    rec = single(graph, "decontaminate", required=False)
    if rec is None or "review" not in rec["stats"]:
        return None
    stats = rec["stats"]
    per = stats["per_benchmark"]
    tiers = table(["benchmark", *(f"flagged: {TIER_NAMES[t]}" for t in TIER_NAMES)],
                  [[b, *(per[b].get(f"flagged_{t}", 0) for t in TIER_NAMES)] for b in sorted(per)]
                  + [["all", *(stats["flagged_by_tier"].get(t, 0) for t in TIER_NAMES)]])
    flagged = {b: table(["document", "tier", "strength", "benchmark item", "document window"],
                        [[f"`{r['doc_id']}`", r["tier"], r["strength"], f"`{r['item_id']}`: {r['item']}", r["window"]]
                         for r in rows])
               for b, rows in stats["review"].items() if rows}
    shown = {b: f"{len(rows)} of {sum(per[b].get(f'flagged_{t}', 0) for t in TIER_NAMES)}"
             for b, rows in stats["review"].items()}
    return {"tiers": tiers, "flagged": flagged, "shown": shown}


def render_report(graph: dict[str, dict]) -> str:
    """Every artifact's config, inputs, code, run and stats, upstream first, then the drill-down."""
    run, built = last_run(graph)
    return render(
        TEMPLATE,
        dag=DAG,
        waterfall_png=WATERFALL,
        quality_png=QUALITY,
        run=run,
        rebuilt=len(built),
        reused=len(graph) - len(built),
        names=list(graph),
        artifacts=[_artifact(name, graph, built) for name in graph],
        drill=_drill(graph, 3),
        review=review(graph),
    )


SVG_STYLE = {True: 'fill="#e3f4e6" stroke="#2e7d32"',  # rebuilt by the last run
             False: 'fill="#f2f2f2" stroke="#8a8a8a" stroke-dasharray="4 3"'}  # reused


def dag_svg(graph: dict[str, dict]) -> str:
    """The artifact graph as a standalone SVG: a box per artifact (stage, hash, and whether the last run
    built or reused it), a column per depth (longest path from a source), an arrow per artifact read."""
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
    height = pad * 2 + max(len(v) for v in columns.values()) * dy - (dy - h) + 30
    edges = [{"x0": pos[u][0] + w, "y0": pos[u][1] + h / 2, "x1": pos[n][0], "y1": pos[n][1] + h / 2}
             for n in graph for u in ups[n]]
    boxes = [{"x": x, "y": y, "stage": graph[n]["stage"], "hash": graph[n]["artifact"]["hash"][:12],
              "rebuilt": n in built or not run, "label": ("rebuilt" if n in built else "reused") if run else ""}
             for n, (x, y) in pos.items()]
    return render(SVG, width=pad * 2 + max(columns) * dx + w, height=height, w=w, h=h, pad=pad, edges=edges,
                  boxes=boxes, style=SVG_STYLE,
                  legend=f"last run: flow run {run}" if run else "no Prefect flow run recorded")


def render_html(card_md: str, report_md: str, plots_dir: Path) -> str:
    """One self-contained HTML page (card, then report); plots inlined as data URIs, nothing fetched."""
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
    body = markdown.markdown(body + "\n\n" + report_md, extensions=["tables", "fenced_code"])
    return render(PAGE, body=body)
