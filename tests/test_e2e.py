"""End to end: a real Prefect server and process worker.

`prefect deploy --all`, then `prefect deployment run pretrain/smoke`.
"""

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from moeflow.ops.stack import LocalStack

pytestmark = pytest.mark.e2e


def test_smoke_deployment_through_server_and_worker(smoke_data, tmp_path, monkeypatch):
    """The deployment run on a stack with its UI on (as `moeflow up` starts it): the flow run's UI page is
    announced while it runs and served; `keep` leaves server and worker running, `stop_kept` stops them."""
    store, home = tmp_path / "store", tmp_path / "prefect-home"
    monkeypatch.setenv("MOEFLOW_STORE", str(store))  # the worker, and so the flow run, inherits it
    announced: list[str] = []
    with LocalStack(home, ui=True) as stack:
        listed = subprocess.run(
            [sys.executable, "-m", "prefect", "deployment", "ls"],
            env=stack.env,
            capture_output=True,
            text=True,
        )
        assert "pretrain/smoke" in listed.stdout and "pretrain/tiny" in listed.stdout
        rc, output, run_id = stack.run_deployment("pretrain/smoke", timeout=600, echo=False,
                                                  on_run=announced.append)
        pids = stack.server.pid, stack.worker.pid
        stack.keep()  # leaving the `with` stops nothing now
    assert rc == 0, output + (home / "worker.log").read_text()[-5000:]
    assert announced == [run_id]
    assert stack.flow_run_url(run_id).startswith("http://127.0.0.1:")
    browser = urllib.request.Request(stack.flow_run_url(run_id), headers={"Accept": "text/html"})
    with urllib.request.urlopen(browser, timeout=10) as page:  # still up: the UI's page, as a browser asks
        assert page.status == 200 and b"<html" in page.read()
    summary = json.loads((store / "runs" / f"{run_id}.json").read_text())
    card = Path(summary["card"])
    assert card.is_file() and card.is_relative_to(store)
    lineage = json.loads((card.parent / "lineage.json").read_text())
    assert lineage["prefect"]["flow_run_id"] == run_id and "deployment_id" in lineage["prefect"]
    assert LocalStack.stop_kept(home)["ui"] == stack.ui_url
    for pid in pids:  # stopped: each process group got SIGTERM
        deadline = time.monotonic() + 30
        while not _exited(pid):
            assert time.monotonic() < deadline, f"process {pid} still runs 30 s after stop_kept"
            time.sleep(0.2)


def _exited(pid: int) -> bool:
    """Whether a process has exited; this test's own children are reaped (else they linger as zombies)."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
