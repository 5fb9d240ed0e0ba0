"""The lineage record written beside every artifact: what made it, from what, with which code, when, where."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys

from prefect.context import FlowRunContext, TaskRunContext

from moeflow import __version__
from moeflow.core.paths import PACKAGE_ROOT


@functools.lru_cache(maxsize=1)
def code_version() -> dict:
    """Git commit and whether the tree had uncommitted changes (a stage's own code hash is in its key)."""
    commit, dirty = "unknown", None
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=PACKAGE_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=PACKAGE_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        dirty = bool(status.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    return {"commit": commit, "dirty": dirty, "moeflow_version": __version__}


def host() -> dict:
    """Where a stage ran. The GPU is named when the stage imported torch (training and evaluation): a data
    stage's worker never imports it just to say it has none."""
    torch = sys.modules.get("torch")
    cuda = torch.cuda.get_device_name(0) if torch is not None and torch.cuda.is_available() else None
    return {**_machine(), "cuda": cuda, "ray_node": _ray_node(), "dask_worker": _dask_worker()}


@functools.lru_cache(maxsize=1)
def _machine() -> dict:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": importlib.metadata.version("torch"),
        "cpus": os.cpu_count(),
    }


def _ray_node() -> str | None:
    """The Ray node id when this runs inside a Ray worker (shard tasks on `execution.runner: ray`)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()


def _dask_worker() -> str | None:
    """The Dask worker's address when this runs inside one (shard tasks on `execution.runner: dask`)."""
    if "distributed" not in sys.modules:
        return None
    from distributed import get_worker  # the optional dask extra, imported already when this runs in a worker

    try:
        return get_worker().address
    except ValueError:  # not in a worker
        return None


def prefect_context() -> dict:
    """Flow-run and task-run ids when called inside Prefect, else empty."""
    out = {}
    flow_ctx, task_ctx = FlowRunContext.get(), TaskRunContext.get()
    if flow_ctx and flow_ctx.flow_run:
        out["flow_run_id"] = str(flow_ctx.flow_run.id)
        out["flow_run_name"] = flow_ctx.flow_run.name
        if flow_ctx.flow_run.deployment_id:
            out["deployment_id"] = str(flow_ctx.flow_run.deployment_id)
    if task_ctx and task_ctx.task_run:
        out["task_run_id"] = str(task_ctx.task_run.id)
    return out
