"""Scale-out: the smoke preset's data stages on a two-node Ray cluster (its store on S3, each node with its
own mirror and no shared folder), and on a Dask scheduler with two workers, give the same artifacts as a
process pool."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import manifest_of, write_config
from moeflow.moe.launch import free_port
from moeflow.store.local import Manifest

WHOLE = ("sources", "ingest", "filter", "dedup", "quality_model", "quality", "benchmarks", "decontaminate",
         "tokenizer", "tokenize", "overlap", "mix")
# the sharded stages' phases and their part counts with `execution.shards: 2` and `dedup.partitions: 2`
PHASES = {"ingest": {"plan": 1, "shard": 2}, "filter": {"shard": 2},
          "dedup": {"sign": 2, "pairs": 2, "clusters": 1, "shard": 2},
          "quality": {"score": 2, "cutoffs": 1, "keep": 2},
          "decontaminate": {"shard": 2}, "tokenize": {"encode": 2}, "overlap": {"shard": 2}}
PARTS = tuple(f"{stage}{'' if phase == 'shard' else '.' + phase}[{r}/{n}]"
              for stage, phases in PHASES.items() for phase, n in phases.items() for r in range(n))
DATA_STAGES = (*WHOLE, *PARTS)

pytestmark = pytest.mark.check  # clusters of several processes: the slower `make check` tier


@pytest.fixture(scope="module")
def ray_cluster(s3, tmp_path_factory):
    """A head and a worker node started with `ray start` on 127.0.0.1, one CPU each: two Ray workers, each
    node with its own object-store mirror (`MOEFLOW_STORE_CACHE`)."""
    ray = shutil.which("ray", path=str(Path(sys.executable).parent))
    port = free_port()
    address = f"127.0.0.1:{port}"
    # token auth (Ray's default) would need the head's token handed to the worker; the cluster is local
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--disable-usage-stats"]
    temp = tmp_path_factory.mktemp("ray")
    try:
        subprocess.run(
            [
                ray,
                "start",
                "--head",
                "--port",
                str(port),
                "--include-dashboard",
                "false",
                "--temp-dir",
                str(temp),
                *common,
            ],
            env={**env, "MOEFLOW_STORE_CACHE": str(temp / "head-mirror")},
            check=True,
            capture_output=True,
            timeout=120,
        )
        subprocess.run(
            [ray, "start", "--address", address, *common],
            env={**env, "MOEFLOW_STORE_CACHE": str(temp / "worker-mirror")},
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.environ["RAY_AUTH_MODE"] = "disabled"  # for this process's ray.init (the driver)
        yield address, temp
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=120)
        os.environ.pop("RAY_AUTH_MODE", None)


@pytest.fixture(scope="module")
def dask_cluster():
    """`dask scheduler` on 127.0.0.1 and two `dask worker` processes (one thread each)."""
    yield from _dask(os.environ)


@pytest.fixture
def dask_cluster_killing_a_worker(tmp_path):
    """A Dask cluster whose workers kill themselves once, halfway through part 1 of the filter's shards
    (`core.faults`; the nanny starts a new worker and the scheduler hands it the part again)."""
    marker = tmp_path / "fired"
    env = {**os.environ, "MOEFLOW_FAULT": "filter.shard:1@half", "MOEFLOW_FAULT_SCOPE": "process",
           "MOEFLOW_FAULT_ONCE": str(marker)}
    for address, _workers in _dask(env):
        yield address, marker


def _dask(env):
    dask = shutil.which("dask", path=str(Path(sys.executable).parent))
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    procs = [
        subprocess.Popen(
            [dask, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    procs += [
        subprocess.Popen(
            [dask, "worker", address, "--nthreads", "1", "--no-dashboard", "--name", f"w{i}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        for i in range(2)
    ]
    from distributed import Client

    try:
        with Client(address, timeout=60) as client:
            client.wait_for_workers(2, timeout=120)
            workers = set(client.scheduler_info()["workers"])
        yield address, workers
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            p.wait(timeout=60)


@pytest.fixture(scope="module")
def pooled(prefect_server, smoke_data, tmp_path_factory):
    """The smoke preset's data stages on the local process pool."""
    from moeflow.flows.pretrain import pretrain

    tmp = tmp_path_factory.mktemp("processes")
    config = write_config(
        tmp / "processes.yaml",
        store=str(tmp / "store"),
        dedup={"partitions": 2},
        execution={"runner": "processes", "workers": 2, "shards": 2},
    )
    return pretrain(config=str(config), until="mix")


def _run_on(tmp_path, store: str | None = None, **execution) -> dict:
    from moeflow.flows.pretrain import pretrain

    config = write_config(
        tmp_path / "cluster.yaml",
        store=store or str(tmp_path / "store"),
        dedup={"partitions": 2},
        execution={"workers": 2, "shards": 2, **execution},
    )
    return pretrain(config=str(config), until="mix")


def _assert_same_artifacts(run: dict, pooled: dict) -> None:
    assert set(run["stages"]) == set(pooled["stages"]) == set(DATA_STAGES)
    for name in DATA_STAGES:  # every artifact: each file's size and xxh3 (ledger included), the manifest hash
        manifests = [manifest_of(r["stages"][name]) for r in (run, pooled)]
        assert manifests[0]["files"] == manifests[1]["files"], name
        assert manifests[0]["hash"] == manifests[1]["hash"], name


def _shard_hosts(run: dict) -> list[dict]:
    """Each part's lineage, of every sharded stage: built by a Prefect task run, on the host it records (ingest's
    plan, a listing, is built in the flow's process)."""
    out = []
    for label in PARTS:
        if label.startswith("ingest.plan"):
            continue
        lineage = Manifest(**manifest_of(run["stages"][label])).lineage()
        assert lineage["prefect"].get("task_run_id")
        out.append(lineage["host"])
    return out


def test_data_stages_on_a_ray_cluster_with_the_store_on_s3_equal_the_process_pool(pooled, ray_cluster, s3,
                                                                                  tmp_path):
    import ray

    address, temp = ray_cluster
    store = f"{s3.bucket('ray')}/store"
    run = _run_on(tmp_path, store=store, runner="ray", ray_address=address)
    _assert_same_artifacts(run, pooled)
    assert all(e["artifact"].startswith(f"{store}/") for e in run["stages"].values())
    # each node read its inputs into its own mirror: the worker node pulled the parts it needed
    assert list((temp / "worker-mirror").rglob("manifest.json"))
    ray.init(address=address)  # the cluster's nodes, to check the shards ran on them
    try:
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    finally:
        ray.shutdown()
    assert len(nodes) == 2
    assert all(h["ray_node"] in nodes for h in _shard_hosts(run))
    assert all(h["ray_node"] is None and h["dask_worker"] is None for h in _shard_hosts(pooled))


def test_data_stages_on_a_dask_cluster_equal_the_process_pool(pooled, dask_cluster, tmp_path):
    address, workers = dask_cluster
    run = _run_on(tmp_path, runner="dask", dask_address=address)
    _assert_same_artifacts(run, pooled)
    assert all(h["dask_worker"] in workers for h in _shard_hosts(run))


def test_a_dask_worker_killed_mid_part_is_replaced_and_the_artifacts_equal_the_process_pool(
        pooled, dask_cluster_killing_a_worker, tmp_path):
    address, marker = dask_cluster_killing_a_worker
    run = _run_on(tmp_path, runner="dask", dask_address=address)
    assert marker.exists(), "no worker reached its kill point"
    _assert_same_artifacts(run, pooled)
