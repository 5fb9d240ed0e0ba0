"""Multi-node training on an object store: every node reads the mix and the checkpoint it resumes from
through the store, not from the first node's mirror. Two nodes on one machine, each with a mirror of its own,
against the real S3 API of tests/s3server.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
from test_parallel import BASE, MODEL, _assert_same_run

from helpers import write_training_mix
from moeflow.configs import TrainConfig
from moeflow.moe import launch, train
from moeflow.store.remote import ObjectStore, SharedFolder


def _two_nodes(mix, work: Path, out: Path, node1_mirror: Path) -> dict:
    """Node 0: the train stage's launch, here; node 1: the command it logs, run with --node-rank=1 in a process
    whose mirror is `node1_mirror`. Returns node 0's summary."""
    cfg = TrainConfig(**BASE, distributed={"nproc_per_node": 1, "nnodes": 2,
                                           "rdzv_endpoint": f"127.0.0.1:{launch.free_port()}"})
    out.mkdir()
    shared = SharedFolder.of(work)
    result: dict = {}

    def node0() -> None:
        try:
            result["summary"] = launch.torchrun(MODEL, cfg, seed=7, mix_dir=mix, tokenizer_dir=mix, out=out,
                                                work=work)
        except Exception as e:  # noqa: BLE001 - reported below
            result["error"] = e

    thread = threading.Thread(target=node0, daemon=True)  # waits for node 1 at the rendezvous
    thread.start()
    spec = f"{shared.base}/{launch.SPEC}"
    for _ in range(600):  # the spec is in the store once node 0 has shared its checkpoint
        shared.fs.invalidate_cache()
        if shared.fs.exists(spec) or not thread.is_alive():
            break
        time.sleep(0.1)
    assert shared.fs.exists(spec), f"node 0 put no launch spec in the store ({result})"
    cmd = [a.replace("--node-rank=0", "--node-rank=1") for a in launch.command(cfg, f"{shared.url}/{launch.SPEC}")]
    node1 = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "MOEFLOW_STORE_CACHE": str(node1_mirror)})
    thread.join(timeout=600)
    assert "error" not in result, result.get("error")
    assert node1.returncode == 0, node1.stdout[-2000:] + node1.stderr[-2000:]
    return result["summary"]


@pytest.mark.check
def test_two_nodes_on_an_object_store_read_the_mix_and_resume_through_the_store(s3, tmp_path, monkeypatch):
    url = f"{s3.bucket(f'b-{uuid.uuid4().hex[:10]}')}/store"
    monkeypatch.setenv("MOEFLOW_STORE_CACHE", str(tmp_path / "node0"))
    store = ObjectStore(url)
    staged = store.staging("mix")
    write_training_mix(staged)
    mix = store.commit("mix", "m", staged, {}, {"stage": "mix"})
    single = tmp_path / "single"
    train.run(MODEL, TrainConfig(**BASE), seed=7, mix_dir=mix.dir, tokenizer_dir=mix.dir, out=single)
    work = store.folder("train", "t").with_name(".train-t.work")  # node 0's, in its mirror

    first = _two_nodes(mix, work, tmp_path / "first", tmp_path / "node1")
    assert first["distributed"]["nnodes"] == 2 and first["resumed_from_step"] is None
    _assert_same_run(single, tmp_path / "first")
    pulled = list((tmp_path / "node1").rglob("mix/mix-m/train.arrow"))
    assert len(pulled) == 1  # node 1 read the mix through the store, into its own mirror
    assert not store.fs.exists(f"{store.base}/train/.train-t.work")  # done: the store keeps no work

    shutil.rmtree(work / "checkpoints" / "step-0000012")  # as if killed after step 8's checkpoint
    again = _two_nodes(mix, work, tmp_path / "again", tmp_path / "node1")
    assert again["resumed_from_step"] == 8
    _assert_same_run(single, tmp_path / "again")
    node1_work = pulled[0].parent.parent.parent / "train" / ".train-t.work"
    assert [p.name for p in (node1_work / "checkpoints").iterdir()] == ["step-0000008"]  # from the store
