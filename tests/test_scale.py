"""Scale-out: filter shards on a local Ray cluster through prefect-ray give the same bytes as a process pool."""

import json
from pathlib import Path

from helpers import write_config


def test_filter_shards_on_ray_equal_the_process_pool(prefect_server, smoke_data, tmp_path):
    from moeflow.flows.pretrain import pretrain

    runs = {}
    for runner in ("processes", "ray"):
        config = write_config(tmp_path / f"{runner}.yaml", store=str(tmp_path / runner), filter={"shards": 2},
                              execution={"runner": runner, "workers": 2})
        runs[runner] = pretrain(config=str(config), until="filter")
    for name in ("filter[0/2]", "filter[1/2]", "filter"):
        manifests = [json.loads((Path(r["stages"][name]["artifact"]) / "manifest.json").read_text()) for r in runs.values()]
        assert manifests[0]["files"] == manifests[1]["files"], name  # every file's size and xxh3
        assert manifests[0]["hash"] == manifests[1]["hash"]
    for runner, r in runs.items():  # the shards were built by Prefect task runs on Ray workers, or not
        for rank in range(2):
            lineage = json.loads((Path(r["stages"][f"filter[{rank}/2]"]["artifact"]) / "lineage.json").read_text())
            assert lineage["prefect"].get("task_run_id")
            assert bool(lineage["host"]["ray_node"]) == (runner == "ray")
