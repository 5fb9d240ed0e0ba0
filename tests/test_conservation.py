"""Conservation across stages: a stage must read exactly the documents its upstream artifact recorded."""

import pytest

from moeflow import configs
from moeflow.core.documents import DocWriter
from moeflow.core.ledger import ConservationError
from moeflow.store.local import Store
from moeflow.tasks.runner import materialize

TEXT = "the quick brown fox jumps over the lazy dog and keeps running through the field " * 5


def _docs_artifact(store: Store, n_written: int, n_recorded: int):
    """A `filter` artifact whose docs file holds `n_written` documents while its record says `n_recorded`."""
    tmp = store.staging("filter")
    with DocWriter(tmp) as writer:
        for i in range(n_written):
            writer.write(
                {"id": f"s/doc{i}", "source": "s", "domain": "d", "path": "p", "text": f"{i} {TEXT}"}
            )
    stats = {"documents_in": n_recorded, "documents_out": n_recorded, "fates": {"kept": n_recorded}}
    lineage = {"stage": "filter", "config": {}, "inputs": {}, "finished_at": "t", "started_at": "t"}
    return store.commit("filter", f"lost{n_written}{n_recorded}", tmp, stats, lineage)


@pytest.mark.parametrize("written,recorded", [(3, 3), (2, 3)])
def test_a_lost_document_fails_the_next_stage_naming_both_counts(tmp_path, written, recorded):
    cfg = configs.load("smoke", store=str(tmp_path / "store"))
    docs = _docs_artifact(Store(cfg.store_path()), written, recorded)
    if written == recorded:
        assert materialize("dedup", cfg, {"docs": docs}).stats["documents_in"] == written
        return
    with pytest.raises(
        ConservationError,
        match=rf"stage dedup: read {written} documents, but its input "
        rf"filter-{docs.hash} recorded {recorded} \(its documents_out\)",
    ):
        materialize("dedup", cfg, {"docs": docs})
    assert not list((tmp_path / "store" / "dedup").glob("dedup-*")), "nothing may be published"


def test_the_ledger_streams_in_row_groups_and_still_names_a_repeated_id(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moeflow.core import ledger as ledgers

    n = ledgers.ROWS_PER_GROUP + 4_465  # two groups: the first written while documents still arrive
    led = ledgers.Ledger("filter", tmp_path)
    for i in range(n):
        led.add(f"doc{i}", "kept" if i % 3 else "dropped", "" if i % 3 else "length.too_short")
    assert len(led.rows["doc_id"]) == n - ledgers.ROWS_PER_GROUP and led.path.stat().st_size > 10_000
    led.write()
    stats = led.check(n, n - len(range(0, n, 3)))
    assert stats["fates"]["dropped:length.too_short"] == len(range(0, n, 3))
    one_shot = tmp_path / "one"
    one_shot.mkdir()
    table = pa.table({"doc_id": [f"doc{i}" for i in range(n)],
                      "fate": ["kept" if i % 3 else "dropped" for i in range(n)],
                      "reason": ["" if i % 3 else "length.too_short" for i in range(n)], "detail": [""] * n},
                     schema=ledgers.SCHEMA)
    pq.write_table(table, one_shot / ledgers.LEDGER, compression="zstd", row_group_size=ledgers.ROWS_PER_GROUP)
    assert led.path.read_bytes() == (one_shot / ledgers.LEDGER).read_bytes()

    again = tmp_path / "again"
    again.mkdir()
    led = ledgers.Ledger("filter", again)
    for i in range(n):
        led.add(f"doc{i}", "kept")
    led.add("doc7", "kept")  # across the group boundary from its first appearance
    led.write()
    with pytest.raises(ConservationError, match=r"stage filter: document id 'doc7' appears twice"):
        led.check(n + 1, n + 1)


# every stage that reads all the documents of an input: (that input, its other inputs from the smoke run)
READERS = {
    "filter": ("docs", {}),
    "dedup": ("docs", {}),
    "quality": ("docs", {"model": "quality_model"}),
    "decontaminate": ("docs", {"index": "benchmarks"}),
    "tokenizer": ("docs", {}),
    "tokenize": ("docs", {"tokenizer": "tokenizer"}),
    "overlap": ("shards", {"tokenizer": "tokenizer", "index": "benchmarks"}),
    "mix": ("shards", {"tokenizer": "tokenizer"}),
    "rung_mix": ("shards", {"tokenizer": "tokenizer"}),
    "proxy_mix": ("shards", {"tokenizer": "tokenizer"}),
}


def _lying_copy(store: Store, manifest, extra: int):
    """`manifest`'s artifact committed again into `store` with `extra` more output documents recorded than
    its files hold."""
    import shutil

    tmp = store.staging(manifest.stage)
    for rel in manifest.files:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(manifest.dir / rel, tmp / rel)
    stats = {**manifest.stats, "documents_out": manifest.stats["documents_out"] + extra}
    lineage = {"stage": manifest.stage, "config": {}, "inputs": {}, "finished_at": "t", "started_at": "t"}
    return store.commit(manifest.stage, f"lying{extra}", tmp, stats, lineage)


def test_every_reading_stage_is_declared_here():
    from moeflow.tasks.registry import STAGES

    declared = {n: r for n, (r, _) in READERS.items()} | {"evaluate": "mix"}  # the held-out rows: below
    assert {n: s.reads for n, s in STAGES.items() if s.reads} == declared


@pytest.mark.parametrize("stage", sorted(READERS))
def test_each_reading_stage_checks_its_count_against_its_inputs_record(smoke_run, tmp_path, stage):
    from moeflow.store.local import Manifest

    path, summary = smoke_run
    cfg = configs.load(path).model_copy(update={"store": str(tmp_path / "store")})
    store = Store(cfg.store_path())
    reads, others = READERS[stage]
    inputs = {name: Manifest.read(summary["stages"][upstream]["artifact"]) for name, upstream in others.items()}
    if reads == "docs":  # a small documents table: the stage runs in seconds
        inputs["docs"] = _docs_artifact(store, 3, 4)
    else:
        inputs["shards"] = _lying_copy(store, Manifest.read(summary["stages"]["tokenize"]["artifact"]), 1)
    read = 3 if reads == "docs" else inputs["shards"].stats["documents_out"] - 1
    with pytest.raises(ConservationError, match=rf"stage {stage}: read {read} documents, but its input "
                                                rf"\w+-{inputs[reads].hash} recorded {read + 1} \(its"):
        materialize(stage, cfg, inputs)
    published = {str(p) for p in (tmp_path / "store" / stage).glob(f"{stage}-*")} - {inputs[reads].path}
    assert not published, "nothing may be published"


def test_evaluate_dropping_a_held_out_row_fails_naming_both_counts(smoke_run, tmp_path, monkeypatch):
    """`evaluate` reads every held-out row of its mix (a domain's loss takes some of them): one it lost is
    caught by the runner against the rows the mix recorded, and nothing is published."""
    from types import SimpleNamespace

    from moeflow.moe import evaluate
    from moeflow.store.local import Manifest
    from moeflow.tokenize import mix

    path, summary = smoke_run
    cfg = configs.load(path).model_copy(update={"store": str(tmp_path / "store")})
    inputs = {name: Manifest.read(summary["stages"][upstream]["artifact"]) for name, upstream in
              {"model": "train", "mix": "mix", "tokenizer": "tokenizer", "index": "benchmarks"}.items()}
    first = mix.read(inputs["mix"].dir / "heldout.arrow").column("domain")[0].as_py()
    recorded = inputs["mix"].stats["heldout_sequences"][first]
    monkeypatch.setattr(evaluate, "mix", SimpleNamespace(read=lambda p: mix.read(p).slice(1)))  # its first row
    with pytest.raises(ConservationError, match=rf"stage evaluate: read {recorded - 1} held-out rows of domain "
                                                rf"'{first}', but its input mix-{inputs['mix'].hash} recorded "
                                                rf"{recorded} \(its heldout_sequences\)"):
        materialize("evaluate", cfg, inputs)
    assert not list((tmp_path / "store").glob("evaluate/evaluate-*")), "nothing may be published"
