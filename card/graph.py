"""The lineage graph a card is generated from: records walked back from artifacts, read by stage."""

from __future__ import annotations

import json
from pathlib import Path

from moeflow.store.url import ensure

DATA_STAGES = ("ingest", "filter", "dedup", "decontaminate")
CARD_STAGES = (*DATA_STAGES, "benchmarks", "tokenizer", "mix", "train", "evaluate")  # each must be unique
OPTIONAL_STAGES = ("overlap", "mix_search", "ladder", "quality_model", "quality", "export")
# the stages whose artifact is documents, in order; quality only when the run configures it
DOCUMENT_STAGES = ("ingest", "filter", "dedup", "quality", "decontaminate")


def artifact_name(artifact: dict) -> str:
    """An artifact's folder name, `<stage>-<hash>`, from a record's `artifact` or one of its `inputs`."""
    return f"{artifact['stage']}-{artifact['hash']}"


def _read(folder: Path) -> dict:
    path = ensure(folder, "lineage.json")  # an object store's record is fetched into this node's mirror
    if not path.exists():
        raise FileNotFoundError(f"{folder} has no lineage.json: not a moeflow artifact")
    return {**json.loads(path.read_text()), "_dir": str(folder)}  # _dir: where to read its files


def collect(roots: list[Path]) -> dict[str, dict]:
    """Artifact name (`<stage>-<hash>`) -> lineage record, for the `roots` and every artifact upstream of
    them, upstream first: a stage with several artifacts (the ladder's rungs) has one entry per artifact."""
    store = roots[0].parent.parent
    tops = [_read(r) for r in roots]
    found: dict[str, dict] = {}
    todo = list(tops)
    while todo:
        rec = todo.pop()
        if artifact_name(rec["artifact"]) not in found:
            found[artifact_name(rec["artifact"])] = rec
            todo += [_read(store / inp["path"]) for inp in rec["inputs"].values()]
    # A reused downstream artifact records the upstream one that built it, which may since have been
    # rebuilt with equal content: one entry per stage and content (the newest), and only what the roots
    # reach through those.
    newest: dict[tuple[str, str], dict] = {}
    for rec in sorted(found.values(), key=lambda r: (r["finished_at"], r["artifact"]["hash"])):
        newest[rec["stage"], rec["artifact"]["content_hash"]] = rec
    kept = {artifact_name(r["artifact"]): r for r in newest.values()}
    graph: dict[str, dict] = {}
    todo = [newest[r["stage"], r["artifact"]["content_hash"]] for r in tops]
    while todo:
        rec = todo.pop()
        if artifact_name(rec["artifact"]) not in graph:
            graph[artifact_name(rec["artifact"])] = rec
            todo += [kept[n] for n in upstream(kept, rec)]
    return _topological(graph)


def upstream(graph: dict[str, dict], rec: dict) -> list[str]:
    """The artifacts of `graph` that `rec` read: each input, or the newer one of equal content kept."""
    names: set[str] = set()
    for inp in rec["inputs"].values():
        same = {n for n, r in graph.items()
                if r["stage"] == inp["stage"] and r["artifact"]["content_hash"] == inp["content_hash"]}
        names |= {artifact_name(inp)} if artifact_name(inp) in graph else same
    return sorted(names)


def _topological(graph: dict[str, dict]) -> dict[str, dict]:
    """Artifacts ordered upstream first (ties by start time, then name), as the DAG reads."""
    ups = {n: upstream(graph, r) for n, r in graph.items()}
    done: dict[str, dict] = {}
    while len(done) < len(graph):
        ready = [n for n in graph if n not in done and all(u in done for u in ups[n])]
        n = min(ready, key=lambda n: (graph[n]["started_at"], n))
        done[n] = graph[n]
    return done


def single(graph: dict[str, dict], stage: str, required: bool = True) -> dict | None:
    """THE record of a stage that runs once per model (ingest, mix, train, evaluate, ...); None when
    absent and not `required`. Fails clearly when the lineage holds several artifacts of it."""
    recs = [r for r in graph.values() if r["stage"] == stage]
    if len(recs) > 1:
        raise ValueError(f"the lineage holds {len(recs)} `{stage}` artifacts, the card needs one: "
                         + ", ".join(artifact_name(r["artifact"]) for r in recs))
    if not recs and required:
        raise KeyError(f"no `{stage}` artifact upstream of the card")
    return recs[0] if recs else None


def by_stage(graph: dict[str, dict]) -> dict[str, dict]:
    """Stage -> THE record, for the stages the card reads: each unique; overlap and ladder when they ran."""
    return ({st: single(graph, st) for st in CARD_STAGES}
            | {st: r for st in OPTIONAL_STAGES if (r := single(graph, st, required=False)) is not None})


def last_run(graph: dict[str, dict]) -> tuple[str | None, set[str]]:
    """The flow run that built the newest artifact of `graph` (the run that made this card, unless only the
    card itself changed), and the artifacts it built; the others it reused from earlier runs."""
    newest = max(graph.values(), key=lambda r: (r["finished_at"], r["started_at"]))
    run = newest["prefect"].get("flow_run_id")
    return run, {n for n, r in graph.items() if run and r["prefect"].get("flow_run_id") == run}
