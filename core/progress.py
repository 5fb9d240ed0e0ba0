"""Live progress in the Prefect UI: progress bars that also keep a progress artifact current, and artifacts
updated in place (the live training table is a markdown one).

Each artifact belongs to the task run doing the work (and so shows on its flow run's page), found from
Prefect's run context or, in a process Prefect did not start (a torchrun rank), from the environment that
`child_env` passes on. Outside a Prefect run, or when the API cannot be reached, nothing is sent and the
work goes on: the UI is a view, never a reason for a stage to fail. Prefect is imported only where a
process already runs it or reports to a run: training outside a flow (`make gpu-check`, the benchmarks) needs no
orchestrator installed.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time

from tqdm import tqdm as _tqdm

log = logging.getLogger(__name__)
ENV_TASK, ENV_FLOW = "MOEFLOW_PREFECT_TASK_RUN", "MOEFLOW_PREFECT_FLOW_RUN"
ENV_NAME = "MOEFLOW_PREFECT_TASK_NAME"


def _context() -> tuple[str | None, str | None, str | None]:
    """(task run id, flow run id, task run name) of the run doing this work, or Nones."""
    if "prefect.context" not in sys.modules:  # Prefect never ran here: no run context, only the environment's
        return os.environ.get(ENV_TASK), os.environ.get(ENV_FLOW), os.environ.get(ENV_NAME)
    from prefect.context import FlowRunContext, TaskRunContext

    task_ctx, flow_ctx = TaskRunContext.get(), FlowRunContext.get()
    if task_ctx is not None:
        return str(task_ctx.task_run.id), str(task_ctx.task_run.flow_run_id), task_ctx.task_run.name
    if flow_ctx is not None and flow_ctx.flow_run is not None:
        return None, str(flow_ctx.flow_run.id), flow_ctx.flow_run.name
    return os.environ.get(ENV_TASK), os.environ.get(ENV_FLOW), os.environ.get(ENV_NAME)


def task_name(default: str) -> str:
    """The name of the task run doing this work (`train`, `rung0`, `tokenize[1/4]`), else `default`."""
    return _context()[2] or default


def child_env() -> dict[str, str]:
    """Environment entries that let a child process (a torchrun rank) report to this task run."""
    task_id, flow_id, name = _context()
    api = {k: os.environ.get(k) for k in ("PREFECT_API_URL", "PREFECT_API_KEY")}
    if "prefect.settings" in sys.modules:  # the API this process talks to, maybe from a settings context
        from prefect.settings import PREFECT_API_KEY, PREFECT_API_URL

        api = {"PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_API_KEY": PREFECT_API_KEY.value()}
    env = {ENV_TASK: task_id, ENV_FLOW: flow_id, ENV_NAME: name, **api}
    # a rank has no run context for Prefect's log handler: its warnings go to its output, read by the parent
    return {k: v for k, v in env.items() if v} | {"PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore"}


def slug(text: str) -> str:
    """A Prefect artifact key: lowercase letters, digits and dashes."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]+", "-", text.lower())).strip("-")[:100] or "progress"


class Artifact:
    """One Prefect artifact of the current task run, created on the first `send` and updated in place."""

    def __init__(self, kind: str, key: str, every_s: float = 2.0):
        self.kind, self.key, self.every_s = kind, slug(key), every_s
        self.task_id, self.flow_id, _ = _context()
        self.id = None
        self.last = 0.0
        self.client = None
        self.live = self.flow_id is not None

    def send(self, data, description: str, force: bool = False) -> None:
        """Create or update the artifact; at most every `every_s` seconds unless `force`."""
        if not self.live or (not force and time.monotonic() - self.last < self.every_s):
            return
        self.last = time.monotonic()
        try:
            self._send(data, description)
        except Exception as e:  # noqa: BLE001 - the UI is a view: its failure must not stop the work
            self.live = False
            log.warning("progress: the Prefect API did not take artifact %s (%s); not updating it again",
                        self.key, e)

    def _send(self, data, description: str) -> None:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate

        if self.client is None:
            self.client = get_client(sync_client=True)
        if self.id is None:
            made = self.client.create_artifact(ArtifactCreate(
                key=self.key, type=self.kind, description=description, data=data,
                task_run_id=self.task_id, flow_run_id=self.flow_id,
            ))
            self.id = made.id
        else:
            self.client.update_artifact(self.id, ArtifactUpdate(data=data, description=description))


class tqdm(_tqdm):  # noqa: N801 - a drop-in for tqdm.tqdm
    """tqdm whose progress also goes to a Prefect progress artifact keyed by its `desc` (or the task run's
    name), created at 0% and updated at most every two seconds; closed with its last count."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._artifact = None
        if not self.disable and self.total:
            self._artifact = Artifact("progress", self.desc or task_name("progress"))
            self._report(force=True)

    def _report(self, force: bool = False) -> None:
        done = min(self.n, self.total)
        if self.unit_scale:  # bytes: "1.34MB of 2.10MB"
            text = f"{self.format_sizeof(done)}{self.unit} of {self.format_sizeof(self.total)}{self.unit}"
        else:
            text = f"{done:,} of {self.total:,} {self.unit}s"
        text = f"{self.desc or 'progress'}: {text}"
        self._artifact.send(round(100.0 * done / self.total, 2), text, force)

    def update(self, n=1):
        shown = super().update(n)
        if self._artifact is not None:
            self._report()
        return shown

    def close(self):
        if getattr(self, "_artifact", None) is not None:
            self._report(force=True)
            self._artifact = None
        super().close()
