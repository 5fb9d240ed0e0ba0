"""A local Prefect stack for `make run` and the end-to-end test: server, worker, deployments, clean stop.

`LocalStack` starts `prefect server start` on 127.0.0.1 (waiting up to `startup_timeout` for its
health check), creates a process work pool, starts a worker on it, deploys `prefect.yaml`, and on
exit stops the worker before the server, each by its PID (process group), and then whatever flow run
processes the worker started (each in a process session of its own). Server and worker run in sessions of
their own, so a Ctrl-C meant for the command reaches neither: the command decides (`cancel`, `stop`). Its
state lives in `home` (PREFECT_HOME); logs are `home/server.log` and `home/worker.log`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from moeflow.core.paths import PACKAGE_ROOT

POOL = "moeflow"
# the watch prints every event of the run: a progress artifact's update (every two seconds a bar) is one
_NOISE = re.compile(r"^(●.*prefect\.artifact\.(created|updated)\b.*|prefect\.artifact\.[0-9a-f-]{36})\s*$")
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}  # flow run states nothing moves on from
QUIET = {"DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


class StackError(RuntimeError):
    """The local stack could not start; the message points at the log to read."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalStack:
    def __init__(
        self, home: Path, *, port: int | None = None, root: Path = PACKAGE_ROOT, startup_timeout: float = 90,
        ui: bool = False,
    ):
        self.home, self.root, self.startup_timeout = (
            Path(home).resolve(),
            Path(root).resolve(),
            startup_timeout,
        )
        self.port = port or free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.ui_url = f"http://127.0.0.1:{self.port}" if ui else None
        self.env = {
            **os.environ,
            **QUIET,
            "PREFECT_UI_ENABLED": "true" if ui else "false",
            "PREFECT_HOME": str(self.home),
            "PREFECT_API_URL": self.api_url,
            "MOEFLOW_ROOT": str(self.root),
        }
        self.env.pop("PREFECT_PROFILES_PATH", None)
        self.server: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None

    def _prefect(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "prefect", *args],
            env=self.env,
            cwd=self.root,
            capture_output=True,
            text=True,
            **kw,
        )

    def _spawn(self, name: str, *args: str, tied: bool = False) -> subprocess.Popen:
        """`prefect ARGS` in a session of its own, logging to `home/NAME.log`; `tied`: it gets SIGTERM when
        this process ends, however it ends (Linux; a SIGKILLed `moeflow run` leaves no server behind)."""
        log = open(self.home / f"{name}.log", "ab")
        return subprocess.Popen(
            [sys.executable, "-m", "prefect", *args],
            env=self.env,
            cwd=self.root,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_end_with_parent if tied and sys.platform == "linux" else None,
        )

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def start(self) -> LocalStack:
        """Server, work pool, worker and deployments."""
        if not (self.root / "prefect.yaml").exists():
            raise StackError(
                f"{self.root} has no prefect.yaml: run moeflow's stack from a checkout of the repository"
            )
        self.start_server()
        made = self._prefect("work-pool", "create", POOL, "--type", "process", "--overwrite")
        if made.returncode != 0:
            self.stop()
            raise StackError(f"could not create work pool {POOL!r}: {made.stdout}{made.stderr}")
        self.worker = self._spawn("worker", "worker", "start", "--pool", POOL, "--type", "process")
        deployed = self._prefect("--no-prompt", "deploy", "--all")
        if deployed.returncode != 0:
            self.stop()
            raise StackError(
                f"`prefect deploy --all` failed:\n{deployed.stdout[-3000:]}{deployed.stderr[-3000:]}"
            )
        return self

    def start_server(self, *extra: str, tied: bool = False) -> LocalStack:
        """The server alone (`extra`: more `prefect server start` options), healthy; `tied`: it ends when this
        process does."""
        self.home.mkdir(parents=True, exist_ok=True)
        self.server = self._spawn(
            "server", "server", "start", "--host", "127.0.0.1", "--port", str(self.port), *extra, tied=tied
        )
        deadline = time.monotonic() + self.startup_timeout
        while not self._healthy():
            if self.server.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise StackError(
                    f"the Prefect server did not become healthy on {self.api_url} within "
                    f"{self.startup_timeout:.0f} s; see {self.home / 'server.log'}"
                )
            time.sleep(0.5)
        return self

    def run_deployment(
        self, name: str, *, timeout: float | None = None, echo: bool = True, on_run=None
    ) -> tuple[int, str, str | None]:
        """`prefect deployment run NAME --watch`: (exit code, output, flow run id); `on_run(id)` is called
        as soon as the flow run's id is printed."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "deployment", "run", name, "--watch"],
            env=self.env,
            cwd=self.root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines = []
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for line in proc.stdout:
                lines.append(line)
                if on_run and (found := re.search(r"UUID:\s*([0-9a-f-]{36})", line)):
                    on_run(found.group(1))
                    on_run = None
                if echo and not _NOISE.match(line):
                    sys.stdout.write(line)
                    sys.stdout.flush()
                if deadline and time.monotonic() > deadline:
                    proc.kill()
                    break
        except BaseException:  # Ctrl-C: the watch goes; the caller cancels the run
            proc.kill()
            proc.wait()
            raise
        rc = proc.wait()
        out = "".join(lines)
        match = re.search(r"UUID:\s*([0-9a-f-]{36})", out)
        return rc, out, match.group(1) if match else None

    def flow_run_url(self, run_id: str) -> str | None:
        return f"{self.ui_url}/runs/flow-run/{run_id}" if self.ui_url else None

    def cancel(self, run_id: str, timeout: float = 90) -> str:
        """Cancel a flow run as `prefect flow-run cancel` does (its state to Cancelling: the worker kills its
        process group and marks it Cancelled) and wait for a final state; returns the state's type
        (`CANCELLED`, or `COMPLETED` etc. for a run that ended first, or the last seen when `timeout` ran out)."""
        state = self.flow_run_state(run_id)
        if state not in FINAL:
            self._prefect("flow-run", "cancel", run_id)
            deadline = time.monotonic() + timeout
            while (state := self.flow_run_state(run_id)) not in FINAL and time.monotonic() < deadline:
                time.sleep(1)
        return state

    def flow_run_state(self, run_id: str) -> str:
        """The flow run's state type from the server's API (`RUNNING`, `CANCELLED`, ...)."""
        with urllib.request.urlopen(f"{self.api_url}/flow_runs/{run_id}", timeout=10) as r:
            return json.load(r)["state_type"]

    def keep(self) -> Path:
        """Leave the server and worker running after this process: their PIDs (and what tells each from a
        later process given the same id) go to `home/stack.json` for `LocalStack.stop_kept` (`moeflow down`)."""
        path = self.home / "stack.json"
        pids = {"server": self.server.pid, "worker": self.worker.pid}
        path.write_text(json.dumps({**pids, "identity": {k: identity(pid) for k, pid in pids.items()},
                                    "ui": self.ui_url, "api": self.api_url}))
        self.server = self.worker = None  # not ours to stop any more
        return path

    @staticmethod
    def stop_kept(home: Path) -> dict | None:
        """Stop a stack `keep` left running (worker first); None when none was kept in `home`. A recorded PID
        that now names another process (after a reboot, say) is not signalled: `skipped` says why."""
        path = Path(home) / "stack.json"
        if not path.exists():
            return None
        kept = json.loads(path.read_text())
        kept["skipped"] = []
        # the worker first, and wholly: killed together, a worker can hang retrying the gone server
        for role in ("worker", "server"):
            pid, recorded = kept[role], kept.get("identity", {}).get(role)
            now = identity(pid)
            if now is None:
                continue  # gone already
            if recorded is None or now != recorded:
                kept["skipped"].append(
                    f"left process {pid} alone: {path} names it as the {role}, but "
                    + ("records no start time to check that by (written by an older moeflow)"
                       if recorded is None else "it is a different process now (it started at another time)")
                    + "; if it is still that Prefect " + role + ", stop it by hand")
                continue
            _terminate(pid)
        path.unlink()
        return kept

    def stop(self, force: bool = False) -> None:
        """Stop the worker, then the server, then any flow run process the worker started; `force`: SIGKILL
        at once."""
        for proc in (self.worker, self.server):  # the worker first: it reports to the server
            if proc is not None and proc.poll() is None:
                _terminate(proc.pid, grace=0 if force else 20)
                proc.wait()

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _terminate(pid: int, grace: float = 20) -> None:
    """SIGTERM a process's group, and SIGKILL it if it has not exited after `grace` seconds; then SIGKILL the
    groups of whatever it had started that is still running (a worker's flow runs run in sessions of their
    own, their pool processes with them)."""
    family = descendants(pid)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)
        deadline = time.monotonic() + wait
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _gone(pid):
            break
    for child in family:
        with contextlib.suppress(ProcessLookupError):
            if not _gone(child) and (group := os.getpgid(child)) != os.getpgrp():
                os.killpg(group, signal.SIGKILL)


def _end_with_parent() -> None:
    """In a child before it execs: the kernel sends it SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG)."""
    import ctypes  # Linux only, and only here

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def identity(pid: int) -> str | None:
    """What tells process `pid` from a later one given the same id: the boot it runs in and its start time
    (clock ticks after boot, /proc/PID/stat field 22), or psutil's create time where there is no /proc.
    None: no such process."""
    if Path("/proc/self/stat").exists():
        try:
            start = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
            return f"{Path('/proc/sys/kernel/random/boot_id').read_text().strip()}/{start}"
        except (FileNotFoundError, ProcessLookupError):
            return None
    try:
        import psutil  # optional, and only here: no /proc (macOS)

        return f"psutil/{psutil.Process(pid).create_time()}"
    except ImportError:
        return f"pid/{pid}"  # nothing better to go by
    except psutil.Error:
        return None


def descendants(pid: int) -> list[int]:
    """Every running process `pid` started, and theirs (read from /proc; none found without it)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(
                int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        found += (kids := children.get(todo.pop(), []))
        todo += kids
    return found


def _gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie, not yet reaped by its parent, counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        if Path("/proc").exists():
            return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False
