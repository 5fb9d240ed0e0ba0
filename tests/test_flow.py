"""The pretrain flow on the smoke preset.

Cold run, full reuse, partial reruns, card regeneration, early failure.
"""

import json
import re
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from huggingface_hub import ModelCard

from helpers import write_config
from moeflow import card
from moeflow.core.documents import iter_docs
from moeflow.core.ledger import read as read_ledger
from moeflow.flows.pretrain import pretrain
from moeflow.ingest import SourceError

UPSTREAM = (
    "sources",
    "ingest",
    "filter",
    "dedup",
    "quality_model",
    "quality",
    "benchmarks",
    "decontaminate",
    "tokenizer",
    "tokenize",
    "overlap",
)


def _whole(stages: dict) -> list[str]:
    """The stages a run made, without the parts of sharded stages (`dedup.sign[0/1]`, `filter[2/3]`)."""
    return [s for s in stages if "[" not in s]


@pytest.fixture(scope="module")
def cold(smoke_run):
    return smoke_run


def test_cold_run_builds_every_stage_and_trains(cold):
    _, summary = cold
    assert _whole(summary["stages"]) == [*UPSTREAM, "mix", "train", "evaluate", "export", "card"]
    assert not any(s["reused"] for s in summary["stages"].values())
    train = json.loads((Path(summary["stages"]["train"]["artifact"]) / "lineage.json").read_text())["stats"]
    assert train["loss_fell"] and train["final_loss"] < train["initial_loss"]
    _report_shows_what_the_run_rebuilt(Path(summary["stages"]["card"]["artifact"]), summary["stages"])


def test_card_reports_what_the_lineage_holds(cold):
    _, summary = cold
    text = Path(summary["card"]).read_text()
    stages = summary["stages"]
    lineage = {s: json.loads((Path(v["artifact"]) / "lineage.json").read_text()) for s, v in stages.items()}
    for name, src in lineage["ingest"]["stats"]["sources"].items():
        assert f"| {name} | {src['package']} | {src['version']} | {src['license']} |" in text
    for stage in ("ingest", "filter", "dedup", "decontaminate"):
        st = lineage[stage]["stats"]
        assert f"| {stage} | {st['documents_in']} | {st['documents_out']} |" in text
    for bench, b in lineage["benchmarks"]["stats"]["benchmarks"].items():
        left = lineage["overlap"]["stats"]["remaining"].get(bench, {}).get("documents", 0)
        assert f"| {bench} | {b['split']} | {b['items']} | {b['items_too_short']} | {b['ngrams']} |" in text
        assert text.split(f"| {bench} |")[1].split("\n")[0].endswith(f"| {left} |")
    ts = lineage["train"]["stats"]
    for fact in (
        f"{ts['params_total']:,}",
        f"{ts['params_active']:,}",
        f"| steps | {ts['steps']} |",
        f"| tokens | {ts['tokens']:,} |",
        f"| {ts['final_loss']} |",
        lineage["train"]["code"]["commit"],
    ):
        assert fact in text
    leak = lineage["mix"]["stats"]["heldout_leakage"]
    for domain, r in lineage["evaluate"]["stats"]["heldout"].items():
        assert r["heldout_documents"] == lineage["mix"]["stats"]["heldout_documents"][domain]
        assert 1 <= r["documents"] <= r["heldout_documents"]
        share = 100 * leak["per_domain"][domain]["share"]
        assert (
            f"| {domain} | {r['loss']} | {r['perplexity']} | {r['sequences']} | {r['tokens']} | "
            f"{r['documents']} of {r['heldout_documents']} | {share:.1f}% | yes |" in text
        )
    assert f"every held-out document's {leak['ngram']}-grams (decontamination's matcher)" in text
    assert (
        f"Checkpoint: the final one of `train-{lineage['train']['artifact']['hash']}` (step {ts['steps']}); "
        f"evaluation code: `evaluate` code `{lineage['evaluate']['code']['source_hash']}`"
    ) in text
    assert "| routing | dropless (no token dropped) |" in text
    phases = lineage["mix"]["stats"]["phases"]
    assert [p["name"] for p in phases] == ["short", "long"] and [p["phase"] for p in ts["phases"]] == [0, 1]
    for ph in phases:
        for d, w in ph["weights"].items():
            assert (
                f"| {ph['name']} | {ph['start_step'] + 1}-{ph['start_step'] + ph['steps']} | "
                f"{ph['seq_len']} | {d} | {w} | "
                f"{ph['target_tokens'].get(d, 0)} | {ph['tokens_per_domain'].get(d, 0)} |"
            ) in text
    for source, counts in lineage["filter"]["stats"]["by_source"].items():
        assert f"| {source} | {counts.get('kept', 0)} | {counts.get('kept:rewritten', 0)} |" in text
    limits = text.split("## Limitations and intended use")[1].split("##")[0]
    assert "- Languages: not identified" in limits  # the smoke preset has no language filter
    assert f"{ts['params_total']:,} parameters trained on {ts['tokens']:,} tokens" in limits
    meta = yaml.safe_load(text.split("---")[1])
    assert meta["license"] == "other" and "PSF-2.0" in meta["license_name"]
    parsed = ModelCard(text).data  # huggingface_hub validates the metadata
    assert {r.dataset_config: r.metric_value for r in parsed.eval_results if r.metric_type == "loss"} == {
        d: r["loss"] for d, r in lineage["evaluate"]["stats"]["heldout"].items()
    }


def test_the_export_loads_in_transformers_and_gives_the_cards_heldout_loss(cold):
    """The folder beside the trained model is a transformers model: loaded by the real library with no remote
    code, its held-out loss per domain (computed here, on evaluation's rows) is the card's within 1e-4, and the
    card and the folder's own README say how to load it and how closely it agreed."""
    import torch
    from transformers import AutoModelForCausalLM

    from moeflow.moe.evaluate import HeldOut

    _, summary = cold
    stages = summary["stages"]
    folder = Path(stages["export"]["artifact"])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen2MoeForCausalLM"
    ev = json.loads((Path(stages["evaluate"]["artifact"]) / "lineage.json").read_text())
    held = HeldOut(Path(stages["mix"]["artifact"]), ev["config"]["max_sequences_per_domain"])
    for domain, picked in held.picked.items():
        rows = torch.from_numpy(held.data[picked])
        with torch.no_grad():
            logits = model(input_ids=rows[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), rows[:, 1:], reduction="none").mean(1)
        assert abs(float(loss.mean()) - ev["stats"]["heldout"][domain]["loss"]) <= 1e-4, domain
    stats = json.loads((folder / "lineage.json").read_text())["stats"]
    assert stats["max_abs_logprob_diff"] <= stats["tolerance"]
    card_text, own = Path(summary["card"]).read_text(), (folder / "README.md").read_text()
    for text in (card_text, own):
        assert yaml.safe_load(text.split("---")[1])["library_name"] == "transformers"
        assert "## Use with transformers" in text
        assert f"differ from moeflow's by at most {stats['max_abs_logprob_diff']}" in text
    assert 'from_pretrained("<store>/export/export-<hash>")' in card_text and 'from_pretrained(".")' in own
    assert folder.name in card_text.split(card.RUN_RECORD)[-1]  # named where what differs between runs is


def test_publish_copies_the_export_to_a_folder_and_lists_an_upload_without_sending(cold, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from moeflow.cli import main

    _, summary = cold
    card_dir, export_dir = (Path(summary["stages"][s]["artifact"]) for s in ("card", "export"))
    assert main(["publish", str(card_dir), "--to", str(tmp_path / "out")]) == 0  # a card stands for its export
    shipped = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert shipped == sorted(str(p.relative_to(export_dir)) for p in export_dir.rglob("*")
                             if p.is_file() and p.name != "manifest.json")
    AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert main(["publish", str(export_dir), "--to", str(tmp_path / "out")]) == 1  # never over a folder
    capsys.readouterr()
    assert main(["publish", str(export_dir), "--to", "someone/moeflow-smoke", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "the Hub repository someone/moeflow-smoke" in out and "model.safetensors" in out
    assert main(["publish", str(Path(summary["stages"]["train"]["artifact"])), "--to", str(tmp_path / "x")]) == 1
    assert "a `train` artifact" in capsys.readouterr().err


def test_card_regenerates_identically_from_lineage(cold, tmp_path):
    _, summary = cold
    card_dir = Path(summary["stages"]["card"]["artifact"])
    card.generate(card_dir, tmp_path)  # from the card artifact: walks to its evaluate input
    for name in (card.CARD, card.REPORT, card.HTML, card.DAG, *(f"plots/{p}" for p in card.plots.PLOTS)):
        assert (tmp_path / name).read_bytes() == (card_dir / name).read_bytes(), name


def test_second_run_reuses_every_stage(cold):
    path, first = cold
    again = pretrain(config=str(path))
    assert all(s["reused"] for s in again["stages"].values())
    assert {k: v["hash"] for k, v in again["stages"].items()} == {
        k: first["stages"][k]["hash"] for k in _whole(first["stages"])
    }


def test_new_mix_weights_rerun_only_mix_and_downstream(cold, tmp_path):
    _, first = cold
    path = write_config(
        tmp_path / "reweighted.yaml",
        store=first["store"],
        mix={"weights": {"literature": 0.6, "python_docs": 0.2, "kernel_docs": 0.2}},
    )
    out = pretrain(config=str(path))
    for stage in UPSTREAM:
        assert out["stages"][stage]["reused"], stage
        assert out["stages"][stage]["hash"] == first["stages"][stage]["hash"]
    for stage in ("mix", "train", "evaluate", "export", "card"):
        assert not out["stages"][stage]["reused"], stage
        assert out["stages"][stage]["hash"] != first["stages"][stage]["hash"]
    _report_shows_what_the_run_rebuilt(Path(out["stages"]["card"]["artifact"]), out["stages"])


def _report_shows_what_the_run_rebuilt(folder: Path, stages: dict) -> None:
    """The card's report and graph mark each artifact of the run's record rebuilt or reused, as it was."""
    report, svg = (folder / card.REPORT).read_text(), (folder / card.DAG).read_text()
    whole = {s: v for s, v in stages.items() if "[" not in s and s != "card"}
    for stage, v in whole.items():
        section = report.split(f"## {stage}: `{stage}-{v['hash']}`\n", 1)[1].split("\n## ", 1)[0]
        assert ("- last run: reused" if v["reused"] else "- last run: rebuilt\n") in section, stage
    rebuilt = sum(not v["reused"] for v in whole.values())
    assert f"{rebuilt} artifact(s) rebuilt, {len(whole) - rebuilt} reused" in report
    assert svg.count(">rebuilt</text>") == rebuilt and svg.count(">reused</text>") == len(whole) - rebuilt


def test_rerun_dedup_keeps_downstream_when_output_is_unchanged(cold):
    path, first = cold
    out = pretrain(config=str(path), rerun=["dedup"])
    assert not out["stages"]["dedup"]["reused"]
    assert out["stages"]["dedup"]["content_hash"] == first["stages"]["dedup"]["content_hash"]
    assert all(v["reused"] for k, v in out["stages"].items() if not k.startswith("dedup"))


def test_until_stops_after_the_stage(cold):
    path, _ = cold
    out = pretrain(config=str(path), until="dedup")
    assert _whole(out["stages"]) == ["sources", "ingest", "filter", "dedup"] and out["card"] is None


@pytest.mark.check
def test_train_stage_launches_torchrun_and_matches_the_single_process_run(cold, tmp_path):
    path, first = cold
    two = write_config(
        tmp_path / "two-ranks.yaml",
        store=first["store"],
        train={**yaml.safe_load(path.read_text())["train"], "distributed": {"nproc_per_node": 2}},
    )
    # the number of ranks is operational: the same artifact unless asked to train again
    assert (
        pretrain(config=str(two), until="train")["stages"]["train"]["hash"]
        == first["stages"]["train"]["hash"]
    )
    out = pretrain(config=str(two), rerun=["train"])
    assert (
        all(out["stages"][s]["reused"] for s in (*UPSTREAM, "mix")) and not out["stages"]["train"]["reused"]
    )
    runs = [
        [
            json.loads(line)
            for line in (Path(r["stages"]["train"]["artifact"]) / "metrics.jsonl").read_text().splitlines()
        ]
        for r in (first, out)
    ]
    assert len(runs[0]) == len(runs[1]) == 40
    for a, b in zip(*runs):  # tolerance as in test_parallel: the same sums in another order
        assert abs(a["ce"] - b["ce"]) <= 1e-4 and a["tokens_per_expert"] == b["tokens_per_expert"], a["step"]
        assert [r["rank"] for r in b["ranks"]] == [0, 1]
    text = Path(out["card"]).read_text()
    assert "### Ranks" in text and "experts split 2 per rank" in text
    assert "share of step time in the token all-to-all, per rank" in text.split(card.RUN_RECORD)[1]
    # rank 0, a process Prefect did not start, updated the train task run's progress and live table
    arts = {a.key: a for a in _flow_run_artifacts(_trained_by(out))}
    assert arts["train"].data == 100 and arts["train-live"].data.startswith("### train: step 40 of 40")


def test_source_matching_nothing_fails_before_any_work(prefect_server, tmp_path):
    store = tmp_path / "store"
    path = write_config(
        tmp_path / "bad.yaml",
        store=str(store),
        sources=[
            {
                "name": "mine",
                "path": str(tmp_path / "nowhere" / "*.jsonl"),
                "format": "jsonl",
                "domain": "literature",
                "license": "cc0",
            }
        ],
        mix={"weights": {"literature": 1.0}, "phases": []},
        filter={"overrides": {}},
        quality=None,  # smoke's classifier keeps by per-domain rules for domains this config has not
    )
    with pytest.raises(SourceError, match="source 'mine'"):
        pretrain(config=str(path))
    assert not store.exists()


def test_a_changed_local_source_file_is_read_again(prefect_server, tmp_path):
    src = tmp_path / "mine.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " * 60}) + "\n" for i in range(3)))
    path = write_config(
        tmp_path / "mine.yaml",
        store=str(tmp_path / "store"),
        sources=[
            {"name": "mine", "path": str(src), "format": "jsonl", "domain": "literature", "license": "cc0"}
        ],
        mix={"weights": {"literature": 1.0}, "phases": []},
        filter={"overrides": {}},
        quality=None,  # smoke's classifier keeps by per-domain rules for domains this config has not
    )
    first = pretrain(config=str(path), until="ingest")
    assert (
        pretrain(config=str(path), until="ingest")["stages"]["ingest"]["hash"]
        == first["stages"]["ingest"]["hash"]
    )
    with src.open(
        "a"
    ) as f:  # same path, new content: the artifacts built from the old content are not reused
        f.write(json.dumps({"text": "document 3 " * 60}) + "\n")
    second = pretrain(config=str(path), until="ingest")
    assert second["stages"]["ingest"]["hash"] != first["stages"]["ingest"]["hash"]
    lineage = json.loads((Path(second["stages"]["ingest"]["artifact"]) / "lineage.json").read_text())
    assert lineage["stats"]["documents_in"] == 4


def test_explain_follows_a_document_through_the_stages(cold, capsys):
    from moeflow.cli import main
    from moeflow.core.ledger import read as read_ledger
    from moeflow.tokenize.mix import read as read_mix

    path, summary = cold
    # a literature document the mix trained on (which ones it samples follows the corpus the stages kept)
    segments = read_mix(Path(summary["stages"]["mix"]["artifact"]) / "train.arrow").column("segments").to_pylist()
    used = sorted({s["doc_id"] for seq in segments for s in seq if s["doc_id"].startswith("shakespeare/")})
    assert main(["explain", used[0], "--config", str(path)]) == 0
    out = capsys.readouterr().out
    for stage in ("ingest", "filter", "dedup", "decontaminate"):
        assert f"{stage:14s} kept" in out
    assert "tokenize       shard-00000.arrow row" in out
    assert "training sequences" in out and ", batch row " in out
    dropped = [
        r
        for r in read_ledger(Path(summary["stages"]["filter"]["artifact"])).to_pylist()
        if r["fate"] == "dropped"
    ]
    assert main(["explain", dropped[0]["doc_id"], "--config", str(path)]) == 0
    assert f"filter         dropped      {dropped[0]['reason']}" in capsys.readouterr().out
    rows = read_ledger(Path(summary["stages"]["quality"]["artifact"])).to_pylist()
    low = next(r for r in rows if r["reason"] == "quality.below_threshold")  # not the incoherent ones
    assert low["fate"] == "dropped" and json.loads(low["detail"])["score"] >= 0
    assert main(["explain", low["doc_id"], "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "dedup          kept" in out
    assert f"quality        dropped      quality.below_threshold {low['detail']}" in out
    assert "decontaminate" not in out  # it left the corpus at quality


def test_card_plots_and_html_report_are_self_contained(cold):
    _, summary = cold
    card_dir = Path(summary["stages"]["card"]["artifact"])
    for name in card.plots.PLOTS:
        assert (card_dir / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"(plots/{name})" in (card_dir / card.CARD).read_text()
    html = (card_dir / card.HTML).read_text()
    # the health plots in the card, the filter waterfall in the report
    assert "<table>" in html and html.count("data:image/png;base64,") == len(card.plots.PLOTS) + 1
    assert not re.search(r"""(src|href)=["'](https?:)?//""", html)  # nothing fetched from the network
    assert "Lineage report" in html and html.count("data:image/svg+xml;base64,") == 1
    svg = (card_dir / card.DAG).read_text()
    rec = json.loads((card_dir / "lineage.json").read_text())
    graph = card.collect([Path(summary["store"]) / i["path"] for i in rec["inputs"].values()])
    assert all(
        f">{r['stage']}</text>" in svg and f">{r['artifact']['hash'][:12]}</text>" in svg
        for r in graph.values()
    )
    assert svg.count("marker-end") == sum(len(card._upstream(graph, r)) for r in graph.values())


def test_card_is_published_as_prefect_artifacts(cold):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["model-card", "stage-stats"]))
        )
    assert {a.key for a in found} == {"model-card", "stage-stats"}


def test_openlineage_events_validate_with_the_client(cold):
    from openlineage.client.event_v2 import InputDataset, Job, OutputDataset, Run, RunEvent, RunState

    from moeflow.lineage.openlineage import events_path

    _, summary = cold
    events = [json.loads(line) for line in events_path(Path(summary["store"])).read_text().splitlines()]
    built = {s for s, v in summary["stages"].items() if not v["reused"] and "[" not in s}
    completed = {e["job"]["name"] for e in events if e["eventType"] == "COMPLETE"}
    assert built <= completed
    for e in events:  # rebuilding each event with the client's classes runs its schema validators
        RunEvent(
            eventType=RunState(e["eventType"]),
            eventTime=e["eventTime"],
            run=Run(runId=e["run"]["runId"]),
            job=Job(namespace=e["job"]["namespace"], name=e["job"]["name"]),
            producer=e["producer"],
            inputs=[InputDataset(namespace=d["namespace"], name=d["name"]) for d in e["inputs"]],
            outputs=[OutputDataset(namespace=d["namespace"], name=d["name"]) for d in e["outputs"]],
        )
    train = next(e for e in events if e["job"]["name"] == "train" and e["eventType"] == "COMPLETE")
    assert {d["name"].split("/")[0] for d in train["inputs"]} == {"mix", "tokenizer"}


def test_report_diffs_configs_and_drills_down_to_raw_files(cold, tmp_path):
    path, first = cold
    for weight in (0.55, 0.45):  # the second mix's record names the first as the previous mix artifact
        reweighted = write_config(
            tmp_path / "mix.yaml",
            store=first["store"],
            mix={"weights": {"literature": weight, "python_docs": 0.25, "kernel_docs": 0.25}},
        )
        out = pretrain(config=str(reweighted))
    report = (Path(out["stages"]["card"]["artifact"]) / card.REPORT).read_text()
    assert "`mix.weights.literature`: 0.55 → 0.45" in report
    assert "## Drill-down: token shards → documents → raw files" in report
    assert re.search(r"\n  - row \d+: `[^`]+` \(\d+ tokens\) from `cache:packages/[^`]+`", report)


def test_a_corrupted_shard_is_caught_before_training(cold, tmp_path):
    from moeflow.store.format import ArtifactError

    path, first = cold
    shard = Path(first["stages"]["mix"]["artifact"]) / "train.arrow"
    original = shard.read_bytes()
    try:
        flipped = bytearray(original)
        flipped[len(flipped) // 2] ^= 0xFF
        shard.write_bytes(bytes(flipped))
        changed = write_config(tmp_path / "steps.yaml", store=first["store"], train={"lr": 0.004})
        with pytest.raises(ArtifactError, match=r"train\.arrow.*--rerun mix"):
            pretrain(config=str(changed))
    finally:
        shard.write_bytes(original)


def test_filter_shards_are_tasks_cached_on_their_own_and_join_to_the_same_bytes(cold, tmp_path):
    import shutil

    path, first = cold
    sharded = write_config(tmp_path / "sharded.yaml", store=first["store"], filter={"shards": 3})
    out = pretrain(config=str(sharded), until="filter", rerun=["filter"])
    shards = [f"filter[{r}/3]" for r in range(3)]
    assert all(not out["stages"][s]["reused"] for s in [*shards, "filter"])
    assert out["stages"]["filter"]["content_hash"] == first["stages"]["filter"]["content_hash"]
    # a lost shard (and the joined artifact): only that shard is computed again
    shutil.rmtree(out["stages"]["filter[1/3]"]["artifact"])
    shutil.rmtree(out["stages"]["filter"]["artifact"])
    again = pretrain(config=str(sharded), until="filter")
    assert [again["stages"][s]["reused"] for s in shards] == [True, False, True]
    assert again["stages"]["filter"]["content_hash"] == first["stages"]["filter"]["content_hash"]
    lineage = json.loads((Path(again["stages"]["filter"]["artifact"]) / "lineage.json").read_text())
    assert [Path(s["path"]).parent.name for s in lineage["shards"]] == ["filter.shard"] * 3


def test_dedup_runs_as_phases_of_parts_and_a_lost_part_is_the_only_work_redone(cold, tmp_path):
    import shutil

    path, first = cold
    parted = write_config(tmp_path / "parted.yaml", store=first["store"], execution={"shards": 3},
                          dedup={"partitions": 2})
    out = pretrain(config=str(parted), until="dedup", rerun=["dedup"])
    parts = [*(f"dedup.sign[{r}/3]" for r in range(3)), "dedup.pairs[0/2]", "dedup.pairs[1/2]",
             "dedup.clusters[0/1]", *(f"dedup[{r}/3]" for r in range(3))]
    assert [s for s in out["stages"] if s.startswith("dedup")] == [*parts, "dedup"]
    assert out["stages"]["dedup"]["content_hash"] == first["stages"]["dedup"]["content_hash"]
    shutil.rmtree(out["stages"]["dedup.sign[1/3]"]["artifact"])
    shutil.rmtree(out["stages"]["dedup"]["artifact"])
    again = pretrain(config=str(parted), until="dedup")
    # the lost part is made again with the same bytes, so every later part is reused
    assert [again["stages"][s]["reused"] for s in parts] == [True, False, *[True] * 7]
    lost = "dedup.sign[1/3]"
    assert again["stages"][lost]["content_hash"] == out["stages"][lost]["content_hash"]
    assert again["stages"]["dedup"]["content_hash"] == first["stages"]["dedup"]["content_hash"]
    lineage = json.loads((Path(again["stages"]["dedup"]["artifact"]) / "lineage.json").read_text())
    phases = {k: len(v) for k, v in lineage["phases"].items()}
    assert phases == {"sign": 3, "pairs": 2, "clusters": 1, "shard": 3}


def test_datatrove_loguru_messages_reach_the_prefect_run_log(prefect_server):
    from loguru import logger
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.context import get_run_context
    from prefect.logging.handlers import APILogHandler

    from moeflow.core.logs import route_loguru

    @flow
    def speaks() -> str:
        route_loguru()
        logger.info("a message from loguru")
        return str(get_run_context().flow_run.id)

    run_id = speaks()
    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
    assert "a message from loguru" in [entry.message for entry in logs]


def test_moeflow_run_on_its_own_server_prints_no_traceback(smoke_data, tmp_path):
    """`moeflow run` with no Prefect server configured starts a temporary one: a run that succeeds prints no
    traceback (the server's telemetry once raced the run for sqlite) and no log error after the server
    stops."""
    import os
    import subprocess
    import sys

    cfg = write_config(tmp_path / "smoke.yaml", store=str(tmp_path / "store"))
    drop = ("PREFECT_API_URL", "DO_NOT_TRACK", "PREFECT_SERVER_ANALYTICS_ENABLED")
    env = {k: v for k, v in os.environ.items() if k not in drop} | {"PREFECT_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "moeflow.cli", "run", str(cfg), "--until", "ingest"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "Traceback" not in out and "Error logging to API" not in out, out
    assert "stopped after ingest" in done.stdout


def test_report_shows_the_filter_waterfall_from_the_ledger_counts(cold):
    """Per source, the documents left after each filter step in the report's table equal the filter's
    ledger counts (read = kept + every drop; each step removes its own reasons), then after dedup and the
    quality stage, whose ledger's drops of the source it shows; the chart is inlined."""
    _, summary = cold
    folder = Path(summary["card"]).parent
    fil = json.loads((Path(summary["stages"]["filter"]["artifact"]) / "lineage.json").read_text())
    quality = Path(summary["stages"]["quality"]["artifact"])
    source_of = {d["id"]: d["source"] for d in iter_docs(Path(summary["stages"]["dedup"]["artifact"]),
                                                          columns=["id", "source"])}
    quality_dropped = Counter(source_of[r["doc_id"]] for r in read_ledger(quality).to_pylist()
                              if r["fate"] == "dropped")
    report = (folder / card.REPORT).read_text()
    steps = list(fil["config"]["steps"])
    table = report.split("## Filter waterfall", 1)[1].split("\n|", 1)[1].split("\n\n", 1)[0]
    header, _, *rows = ("|" + table).splitlines()
    assert [c.strip() for c in header.strip("|").split("|")] == ["source", "read", *steps, "dedup", "quality"]
    assert {r.split("|")[1].strip() for r in rows} == set(fil["stats"]["by_source"])
    for row in rows:
        src, *cells = [c.strip() for c in row.strip("|").split("|")]
        counts = fil["stats"]["by_source"][src]
        left = [int(c.split()[0]) for c in cells]
        assert left[0] == sum(n for k, n in counts.items() if k == "kept" or k.startswith("dropped:"))
        for i, step in enumerate(steps, start=1):
            removed = sum(n for k, n in counts.items() if k.startswith(f"dropped:{step}."))
            assert left[i - 1] - left[i] == removed, (src, step)
        assert left[len(steps)] == counts["kept"]
        assert left[-2] == sum(s == src for s in source_of.values())  # what dedup left of the source
        assert left[-2] - left[-1] == quality_dropped[src]
    assert (folder / "plots" / "filter_waterfall.png").stat().st_size > 1000
    assert "(plots/filter_waterfall.png)" not in (folder / card.HTML).read_text()  # inlined


def test_report_shows_quality_kept_per_domain_with_score_histograms(cold):
    _, summary = cold
    report = (Path(summary["card"]).parent / card.REPORT).read_text()
    stats = json.loads((Path(summary["stages"]["quality"]["artifact"]) / "lineage.json").read_text())["stats"]
    section = report.split("## Quality scores", 1)[1].split("\n## ", 1)[0]
    for domain, d in stats["by_domain"].items():
        assert f"| {domain} | {d['documents']} | {d['kept']} | " in section
        assert " ".join(str(n) for n in d["histogram"]) in section
    n = stats["by_domain"]["literature"]["documents"]
    assert f"| literature | {n} | {n} | threshold 0.0 |" in section  # every play kept, by its override
    row = f"| quality | {stats['documents_in']} | {stats['documents_out']} |"
    assert row in Path(summary["card"]).read_text()  # the model card's data stages
    assert row in (Path(summary["card"]).parent / "dataset_card.md").read_text()


def test_report_tables_the_classifiers_metrics_and_links_each_positive_to_the_artifact_that_fetched_it(cold):
    _, summary = cold
    report = (Path(summary["card"]).parent / card.REPORT).read_text()
    model = json.loads((Path(summary["stages"]["quality_model"]["artifact"]) / "lineage.json").read_text())
    held, name = model["stats"]["heldout"], f"quality_model-{model['artifact']['hash']}"
    sources = Path(summary["stages"]["sources"]["artifact"]).name
    section = report.split("## Quality classifier", 1)[1].split("\n## ", 1)[0]
    assert (f"| `{name}` | trained | `__label__hq` | {held['precision']} | {held['recall']} | {held['roc_auc']} | "
            f"{held['positives']} | {held['negatives']} |") in section
    for p in model["config"]["positives"]:
        ident = model["key"]["fetched"][f"package:{p['package']}"]
        assert (f"| `{p['name']}` | package `{p['package']}`: `{p['path']}` | version {ident['version']}, sha256 "
                f"`{ident['sha256']}`, tree `{ident['tree']}` | fetched by `{sources}` |") in section
    assert report.index("## Quality classifier") < report.index("## Quality scores")


def _trained_by(summary: dict) -> str:
    """The flow run that built `summary`'s train artifact (a later run may have rebuilt it in place)."""
    train = Path(summary["stages"]["train"]["artifact"])
    return json.loads((train / "lineage.json").read_text())["prefect"]["flow_run_id"]


def _flow_run_artifacts(run_id: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))


def test_long_stages_show_progress_artifacts_that_reach_100(cold):
    """Every long stage (each part of a sharded one, the benchmark index, training) has a progress artifact on
    the flow run, finished at 100%, its description counting what was done."""
    progress = [a for a in _flow_run_artifacts(cold[1]["flow_run_id"]) if a.type == "progress"]
    keys = {a.key for a in progress}
    long = ("ingest", "filter", "dedup-sign", "benchmarks", "decontaminate", "tokenize", "overlap", "train")
    for stage in long:
        assert any(k.startswith(stage) for k in keys), (stage, keys)
    assert all(a.data == 100 for a in progress), {a.key: a.data for a in progress}
    train = next(a for a in progress if a.key == "train")
    assert train.description == "train: 40 of 40 steps"


def test_training_shows_a_live_table_with_alarms_and_tensorboard(cold):
    """The training table (one artifact, updated in place) ends on the last step: its rows are the logged
    steps of metrics.jsonl, newest first, and it names the TensorBoard folder."""
    tables = [a for a in _flow_run_artifacts(_trained_by(cold[1])) if a.key == "train-live"]
    assert len(tables) == 1 and tables[0].type == "markdown"
    md = tables[0].data
    metrics = Path(cold[1]["stages"]["train"]["artifact"]) / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    logged = [r for r in records if r["step"] % 10 == 0]
    rows = [line.split(" | ") for line in md.splitlines() if re.match(r"^\| \d+ \|", line)]
    assert [int(r[0].strip("| ")) for r in rows] == [r["step"] for r in reversed(logged)]
    assert [r[2] for r in rows] == [f"{r['loss']:.4f}" for r in reversed(logged)]
    assert md.startswith("### train: step 40 of 40 (100%)")
    assert re.search(r"tensorboard --logdir \S+\.work/tensorboard", md)


def test_training_alarms_show_in_the_live_table_and_the_run_log_as_they_fire(cold, tmp_path):
    """Alarms set to fire on any grad-norm rise: each one is listed in the live table and sent to the
    flow run's log (the UI's Logs tab) by the training step that raised it."""
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.context import get_run_context
    from prefect.logging.handlers import APILogHandler

    from moeflow import configs
    from moeflow.configs import AlarmConfig
    from moeflow.core.logs import route_moeflow_logs
    from moeflow.moe import train

    cfg = configs.load(str(cold[0]))
    touchy = AlarmConfig(window=2, grad_norm_sigma=0.001, grad_norm_ratio=1.0)
    train_cfg = cfg.train.model_copy(update={"steps": 12, "log_every": 4, "alarms": touchy})
    stages = cold[1]["stages"]

    @task(task_run_name="watched")
    def trains(out: Path) -> dict:
        return train.run(cfg.model, train_cfg, seed=1, mix_dir=Path(stages["mix"]["artifact"]),
                         tokenizer_dir=Path(stages["tokenizer"]["artifact"]), out=out)

    @flow
    def watched(out: Path) -> tuple[str, dict]:
        route_moeflow_logs()
        return str(get_run_context().flow_run.id), trains(out)

    run_id, summary = watched(tmp_path / "out")
    APILogHandler().flush()
    alarms = summary["alarms"]
    assert alarms, "the touchy thresholds should fire"
    with get_client(sync_client=True) as client:
        logs = [e.message for e in client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(
            any_=[run_id])))]
    table = _flow_run_artifacts(run_id)
    md = next(a for a in table if a.key == "watched-live").data
    assert f"**Alarms ({len(alarms)})**" in md
    for a in alarms[-10:]:
        assert f"- step {a['step']}: {a['alarm']}" in md
    for a in alarms:
        assert f"train: step {a['step']} alarm {a['alarm']} ({a['action']})" in logs


def _scores(summary: dict) -> dict:
    ev = Path(summary["stages"]["evaluate"]["artifact"])
    return json.loads((ev / "lineage.json").read_text())["stats"]["benchmarks"], ev


def test_card_reports_benchmark_scores_with_chance_and_model_index(cold):
    """The smoke preset's scorable benchmarks (ARC's two sets, PIQA, LAMBADA) are scored on 100 sampled
    items each; the card's table and model-index carry every value the evaluate artifact recorded."""
    got, ev = _scores(cold[1])
    assert set(got) == {"arc_easy", "arc_challenge", "piqa", "lambada"}
    assert all(r["samples"] == 100 for r in got.values())
    items = [json.loads(line) for line in (ev / "benchmarks.jsonl").read_text().splitlines()]
    assert len(items) == 400 and {len(i["loglikelihoods"]) for i in items if i["task"] == "piqa"} == {2}
    for task, r in got.items():  # each summary is the mean of its items
        mine = [i["acc"] for i in items if i["task"] == task]
        assert r["acc"] == round(sum(mine) / len(mine), 4)
    # a few ARC questions have 3 or 5 choices
    assert abs(got["arc_easy"]["chance"] - 0.25) < 0.01 and got["piqa"]["chance"] == 0.5
    assert got["lambada"]["chance"] is None
    text = Path(cold[1]["card"]).read_text()
    for task, r in got.items():
        assert f"| {task} | {r['benchmark']} | acc | {r['acc']} | {r['acc_stderr']} |" in text
    results = {(e.dataset_type, e.metric_type): e.metric_value for e in ModelCard(text).data.eval_results}
    assert {(t, m): v for (t, m), v in results.items() if m != "loss"} == {
        (t, m): r[m] for t, r in got.items() for m in ("acc", "acc_norm") if m in r}
    near = sum(r[m] - r["chance"] <= 2 * r[f"{m}_stderr"] for r in got.values() if r["chance"]
               for m in ("acc", "acc_norm") if m in r)
    assert f"{near} of 6 scores are no more than two standard errors above chance" in text


PROSE = ("The afternoon was spent in the library, where the light came through the tall windows and fell "
         "across the long tables. Some of us read quietly while others argued about the meaning of the "
         "passages we had been given, and the teacher walked between the rows, listening more than she "
         "spoke. When the bell rang we packed our books slowly, still talking about what we had read, and "
         "agreed to meet again the following week to continue the discussion.")


ANIMALS = ["fox", "heron", "badger", "otter", "raven", "hare", "stag", "wren", "mole", "newt"]
PLACES = ["the old mill", "the salt marsh", "the northern hills", "the chapel yard", "the river ford"]


def _own_eval_set(path: Path) -> list[dict]:
    """30 questions of a made-up eval set: choices as a list, the answer as an index, a text or a letter."""
    rows = []
    for i in range(30):
        a, p = ANIMALS[i % 10], PLACES[i % 5]
        choices = [f"a basket of {x}" for x in ("apples", "stones", "letters")]
        answer = [i % 3, choices[i % 3], "ABC"[i % 3]][i % 3]
        rows.append({"qid": f"q{i}", "question": f"In the tale of the {a} who walked every morning to {p}, "
                     f"what did the {a} carry home on the {i + 1}th day of the long dry summer?",
                     "choices": choices, "answer": answer, "notes": "not indexed"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_your_own_eval_set_is_indexed_checked_and_scored(cold, tmp_path):
    """A local JSONL eval set (question, choices, answer fields) beside the bundled benchmarks: its file is
    in the index's key, its items are indexed, decontamination finds the one planted in a local source,
    evaluate scores all 30, and the card lists it and flags it, its score on the 29 clean items beside all."""
    path, first = cold
    rows = _own_eval_set(tmp_path / "mine.jsonl")
    leak = tmp_path / "leak.jsonl"
    leak.write_text(json.dumps({"text": "Notes from the reading group.\n\n" + rows[7]["question"] + "\n\n"
                                + PROSE}) + "\n")
    smoke = yaml.safe_load(path.read_text())
    mine = {"name": "mine", "path": str(tmp_path / "mine.jsonl"), "id_field": "qid",
            "text_fields": ["question", "choices"], "question": "question", "choices": "choices",
            "answer": "answer"}
    cfg = write_config(tmp_path / "own.yaml", store=first["store"], benchmarks=smoke["benchmarks"] + [mine],
                       sources=smoke["sources"] + [{"name": "leak", "path": str(leak), "format": "jsonl",
                                                    "domain": "literature", "license": "cc0"}],
                       decontaminate={"action": "cut"})
    out = pretrain(config=str(cfg))
    index = json.loads((Path(out["stages"]["benchmarks"]["artifact"]) / "lineage.json").read_text())
    assert index["key"]["fetched"]["file:benchmark:mine"]["bytes"] == (tmp_path / "mine.jsonl").stat().st_size
    stats = index["stats"]["benchmarks"]["mine"]
    assert (stats["items"], stats["scorable_items"], stats["items_too_short"]) == (30, 30, 0)
    decon = pq.read_table(Path(out["stages"]["decontaminate"]["artifact"]) / "ledger.parquet").to_pylist()
    found = [json.loads(r["detail"]) for r in decon if r["reason"] == "cut"]
    assert [(f["benchmark"], f["item_id"]) for f in found] == [("mine", "q7")]
    got, ev = _scores(out)
    assert got["mine"]["samples"] == 30 and got["mine"]["chance"] == round(1 / 3, 4)
    items = [json.loads(line) for line in (ev / "benchmarks.jsonl").read_text().splitlines()]
    clean = [i["acc"] for i in items if i["task"] == "mine" and i["item_id"] != "q7"]
    assert len(clean) == 29
    text = Path(out["card"]).read_text()
    assert f"| mine | mine | acc | {got['mine']['acc']} | {got['mine']['acc_stderr']} | 0.3333 | 30 |" in text
    assert f"⚠ 1 of 30 items found in training data; clean: {round(sum(clean) / 29, 4)} (29 items)" in text
    assert text.split("Held-out documents (never trained on)")[0].count("⚠") == 1  # no other task flagged
    assert "Flagged (decontamination found some of the sampled items in training documents" in text
