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
from types import SimpleNamespace

import browser
import pytest

from moeflow import card
from moeflow.cli.stack import LocalStack

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def kept(smoke_data, tmp_path_factory):
    """The smoke deployment run on a stack with its UI on, left running (as `moeflow up --keep` leaves it)."""
    tmp = tmp_path_factory.mktemp("e2e")
    store, home = tmp / "store", tmp / "prefect-home"
    announced: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOEFLOW_STORE", str(store))  # the worker, and so the flow run, inherits it
        with LocalStack(home, ui=True) as stack:
            listed = subprocess.run([sys.executable, "-m", "prefect", "deployment", "ls"], env=stack.env,
                                    capture_output=True, text=True)
            rc, output, run_id = stack.run_deployment("pretrain/smoke", timeout=600, echo=False,
                                                      on_run=announced.append)
            pids = stack.server.pid, stack.worker.pid
            stack.keep()  # leaving the `with` stops nothing now
    yield SimpleNamespace(stack=stack, store=store, home=home, listed=listed.stdout, rc=rc, output=output,
                          run_id=run_id, announced=announced, pids=pids)
    LocalStack.stop_kept(home)  # when a test failed before stopping them


def test_smoke_deployment_through_server_and_worker(kept):
    """The deployment run through server and worker: the flow run's UI page is announced while it runs and
    served; its record names the card, whose lineage names the flow run and deployment."""
    assert "pretrain/smoke" in kept.listed and "pretrain/tiny" in kept.listed
    assert kept.rc == 0, kept.output + (kept.home / "worker.log").read_text()[-5000:]
    assert kept.announced == [kept.run_id]
    url = kept.stack.flow_run_url(kept.run_id)
    assert url.startswith("http://127.0.0.1:")
    browser_asks = urllib.request.Request(url, headers={"Accept": "text/html"})
    with urllib.request.urlopen(browser_asks, timeout=10) as page:  # still up: the UI's page
        assert page.status == 200 and b"<html" in page.read()
    card = Path(_summary(kept)["card"])
    assert card.is_file() and card.is_relative_to(kept.store)
    lineage = json.loads((card.parent / "lineage.json").read_text())
    assert lineage["prefect"]["flow_run_id"] == kept.run_id and "deployment_id" in lineage["prefect"]


def _summary(kept) -> dict:
    return json.loads((kept.store / "runs" / f"{kept.run_id}.json").read_text())


def test_the_ui_shows_the_run_its_card_and_live_training_in_chromium(kept):
    """Headless Chromium opens the flow run page on the kept server and the lineage report: the task runs,
    the model-card artifact, a progress artifact at 100% and the training table are in the DOM; screenshots
    are saved under the store's `screenshots/RUN_ID/` for a person to look at."""
    if (reason := browser.why_not()) is not None:
        pytest.skip(reason)
    assert kept.rc == 0, kept.output
    summary, url = _summary(kept), kept.stack.flow_run_url(kept.run_id)
    shots = kept.store / "screenshots" / kept.run_id
    with browser.page(shots) as pg:
        pg.goto(url)
        browser.see(pg, "Completed")
        browser.see(pg, "Task Runs").click()
        for task_run in summary["stages"]:  # every stage and part the run record names
            browser.see(pg, task_run)
        browser.shot(pg, shots, "flow-run-graph-and-task-runs")
        _artifacts_tab(pg, url, shots)
        browser.see(pg, "model-card").click()
        browser.see(pg, "moeflow-smoke-moe")  # the card's title, rendered from its markdown
        browser.shot(pg, shots, "model-card")
        _artifacts_tab(pg, url, shots)
        browser.see(pg, "train").click()
        browser.see(pg, "Progress: 100%")
        browser.shot(pg, shots, "training-progress")
        _artifacts_tab(pg, url, shots)
        browser.see(pg, "train-live").click()
        browser.see(pg, "train: step 40 of 40 (100%)")
        browser.see(pg, "imbalance per layer (max/mean)")
        browser.shot(pg, shots, "training-table")
        pg.goto(Path(summary["card"]).with_name(card.HTML).as_uri())
        browser.see(pg, "Filter waterfall")
        assert pg.locator("img[alt^='artifact graph']").first.evaluate("i => i.naturalWidth") > 0
        browser.shot(pg, shots, "lineage-report")
    names = {"flow-run-graph-and-task-runs", "flow-run-artifacts", "model-card", "training-progress",
             "training-table", "lineage-report"}
    assert {p.stem for p in shots.glob("*.png")} == names
    assert all((shots / f"{n}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)


def _artifacts_tab(pg, url: str, shots: Path) -> None:
    """The flow run's Artifacts tab: the card, the stage table, the training table and progress artifacts."""
    pg.goto(url)
    browser.see(pg, "Artifacts").click()
    for key in ("model-card", "dataset-card", "stage-stats", "train-live", "train", "benchmarks"):
        browser.see(pg, key)
    if not (shots / "flow-run-artifacts.png").exists():
        browser.shot(pg, shots, "flow-run-artifacts")


def test_stop_kept_stops_server_and_worker(kept):
    """`moeflow down`: the kept server and worker each get SIGTERM and exit."""
    assert LocalStack.stop_kept(kept.home)["ui"] == kept.stack.ui_url
    for pid in kept.pids:
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
