"""Scale-out: the smoke preset's data stages on a two-node Ray cluster give the same artifacts as a process pool."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import write_config

DATA_STAGES = ("sources", "ingest", "filter[0/2]", "filter[1/2]", "filter", "dedup", "benchmarks", "decontaminate",
               "tokenizer", "tokenize", "overlap", "mix")


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A head and a worker node started with `ray start` on 127.0.0.1, one CPU each: two Ray workers."""
    ray = shutil.which("ray", path=str(Path(sys.executable).parent))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    # token auth (Ray's default) would need the head's token handed to the worker; the cluster is local
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--disable-usage-stats"]
    temp = tmp_path_factory.mktemp("ray")
    try:
        subprocess.run([ray, "start", "--head", "--port", str(port), "--include-dashboard", "false",
                        "--temp-dir", str(temp), *common], env=env, check=True, capture_output=True, timeout=120)
        subprocess.run([ray, "start", "--address", address, *common], env=env, check=True, capture_output=True,
                       timeout=120)
        os.environ["RAY_AUTH_MODE"] = "disabled"  # for this process's ray.init (the driver)
        yield address
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=120)
        os.environ.pop("RAY_AUTH_MODE", None)


def test_data_stages_on_a_ray_cluster_equal_the_process_pool(prefect_server, smoke_data, ray_cluster, tmp_path):
    import ray

    from moeflow.flows.pretrain import pretrain

    runs = {}
    for runner, extra in (("processes", {}), ("ray", {"ray_address": ray_cluster})):
        config = write_config(tmp_path / f"{runner}.yaml", store=str(tmp_path / runner), filter={"shards": 2},
                              execution={"runner": runner, "workers": 2, **extra})
        runs[runner] = pretrain(config=str(config), until="mix")
    assert set(runs["ray"]["stages"]) == set(DATA_STAGES)
    for name in DATA_STAGES:  # every artifact: each file's size and xxh3 (ledger included), and the manifest hash
        manifests = [json.loads((Path(r["stages"][name]["artifact"]) / "manifest.json").read_text())
                     for r in runs.values()]
        assert manifests[0]["files"] == manifests[1]["files"], name
        assert manifests[0]["hash"] == manifests[1]["hash"], name
    ray.init(address=ray_cluster)  # the cluster's nodes, to check the shards ran on them
    try:
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    finally:
        ray.shutdown()
    assert len(nodes) == 2
    for runner, r in runs.items():  # the shards were built by Prefect task runs on the cluster's nodes, or not
        for rank in range(2):
            lineage = json.loads((Path(r["stages"][f"filter[{rank}/2]"]["artifact"]) / "lineage.json").read_text())
            assert lineage["prefect"].get("task_run_id")
            assert (lineage["host"]["ray_node"] in nodes) if runner == "ray" else lineage["host"]["ray_node"] is None
