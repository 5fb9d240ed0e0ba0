"""Builders both cards share: Markdown tables, documents per stage, filter decisions, duplicate clusters."""

from __future__ import annotations

RUN_RECORD = "## Run record (differs between runs)"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


SECONDS = "seconds"


def seconds(rec: dict) -> str:
    """A stage's time as the cards show it: a sharded stage's wall time from its first part's start to its
    join's end, with its parts' seconds summed; any other stage's own."""
    if "wall_seconds" in rec:
        return (f"{rec['wall_seconds']} wall from its first part's start ({rec['parts_seconds']} in parts, "
                f"{rec['seconds']} joining)")
    return str(rec["seconds"])


def fates(stats: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in stats.get("fates", {}).items() if k != "kept") or "none"


def stages_table(records: list[dict]) -> str:
    """Documents in and out of each data stage, and what it removed."""
    rows = [[r["stage"], r["stats"]["documents_in"], r["stats"]["documents_out"], fates(r["stats"])]
            for r in records]
    return table(["stage", "documents in", "documents out", "removed (fate:reason count)"], rows)


def filter_table(stats: dict) -> str | None:
    """Per source: kept, rewritten, and dropped per `step.reason`; None when the filter kept no such counts."""
    if "by_source" not in stats:
        return None
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
    return table(["source", "kept", "of which rewritten", "dropped (step.reason count)"], rows)


def dedup_clusters(stats: dict) -> dict:
    """Exact and MinHash cluster counts, and a table of them by size (None when no duplicate was found)."""
    exact, near = stats.get("cluster_sizes", {}), stats.get("minhash_cluster_sizes", {})
    sizes = sorted({*exact, *near}, key=int)
    rows = [[z, exact.get(z, 0), near.get(z, 0)] for z in sizes]
    return {"exact": stats.get("duplicate_clusters", 0), "minhash": stats.get("minhash_clusters", 0),
            "table": table(["cluster size", "exact clusters", "MinHash clusters"], rows) if sizes else None}


def edited_tier(cfg: dict) -> str | None:
    """The sentence that says how the second tier flags an edited item; None where it was off."""
    if not cfg.get("edited"):
        return None
    return (f"A second tier flags benchmark items edited so that no indexed n-gram is left intact: an item "
            f"whose {cfg['edited_ngram']}-word n-grams cluster in a document is aligned word for word with it, "
            f"and flagged when runs of two or more words cover at least {cfg['edited_min_strength']:.0%} "
            f"of the item's words (and {cfg['edited_min_words']} words); the flagged-by-tier columns count "
            "documents by the tier of their first flag.")
