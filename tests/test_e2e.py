"""End to end: a real Prefect server and process worker.

`prefect deploy --all`, then `prefect deployment run pretrain/smoke`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moeflow.ops.stack import LocalStack

pytestmark = pytest.mark.e2e


def test_smoke_deployment_through_server_and_worker(smoke_data, tmp_path, monkeypatch):
    store = tmp_path / "store"
    monkeypatch.setenv("MOEFLOW_STORE", str(store))  # the worker, and so the flow run, inherits it
    with LocalStack(tmp_path / "prefect-home") as stack:
        listed = subprocess.run(
            [sys.executable, "-m", "prefect", "deployment", "ls"],
            env=stack.env,
            capture_output=True,
            text=True,
        )
        assert "pretrain/smoke" in listed.stdout and "pretrain/tiny" in listed.stdout
        rc, output, run_id = stack.run_deployment("pretrain/smoke", timeout=600, echo=False)
        worker_pid = stack.worker.pid
    assert rc == 0, output + (tmp_path / "prefect-home" / "worker.log").read_text()[-5000:]
    summary = json.loads((store / "runs" / f"{run_id}.json").read_text())
    card = Path(summary["card"])
    assert card.is_file() and card.is_relative_to(store)
    lineage = json.loads((card.parent / "lineage.json").read_text())
    assert lineage["prefect"]["flow_run_id"] == run_id and "deployment_id" in lineage["prefect"]
    with pytest.raises(ProcessLookupError):  # the stack stopped its worker
        os.kill(worker_pid, 0)
