"""Markdown sections both cards print: tables, removal counts, filter decisions, duplicate clusters."""

from __future__ import annotations

RUN_RECORD = "## Run record (differs between runs)"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fates(stats: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in stats.get("fates", {}).items() if k != "kept") or "none"


def filter_section(stats: dict) -> list[str]:
    if "by_source" not in stats:
        return []
    rows = [
        [
            src,
            c.get("kept", 0),
            c.get("kept:rewritten", 0),
            ", ".join(
                f"{k.removeprefix('dropped:')} {n}"
                for k, n in sorted(c.items(), key=lambda x: (-x[1], x[0]))
                if k.startswith("dropped:")
            )
            or "none",
        ]
        for src, c in sorted(stats["by_source"].items())
    ]
    return [
        "",
        "### Filter decisions per source",
        "",
        "Documents kept, kept after a rewrite (C4 removes lines), and dropped per filter step and reason "
        "(`step.reason`, datatrove's reason strings for its blocks), most frequent first.",
        "",
        table(["source", "kept", "of which rewritten", "dropped (step.reason count)"], rows),
    ]


def dedup_section(stats: dict) -> list[str]:
    exact, near = stats.get("cluster_sizes", {}), stats.get("minhash_cluster_sizes", {})
    sizes = sorted({*exact, *near}, key=int)
    return [
        "",
        "### Duplicate clusters",
        "",
        f"{stats.get('duplicate_clusters', 0)} exact clusters and {stats.get('minhash_clusters', 0)} "
        "MinHash clusters; each keeps its smallest document id. Clusters by size (documents in the "
        "cluster):",
        "",
        table(
            ["cluster size", "exact clusters", "MinHash clusters"],
            [[z, exact.get(z, 0), near.get(z, 0)] for z in sizes],
        )
        if sizes
        else "No duplicates found.",
    ]
