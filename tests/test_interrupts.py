"""Interrupts: Ctrl-C and SIGTERM on `moeflow up` and `moeflow run`, `moeflow down` after process ids were
reused, and a pool worker the kernel killed (as its OOM killer does)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from helpers import write_config
from moeflow.cli import main
from moeflow.cli.stack import LocalStack, descendants, identity
from moeflow.tasks.pipeline import PoolProcessDied


def _alive(pid: int) -> bool:
    return identity(pid) is not None and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""  # gone


def test_down_leaves_alone_a_process_that_reused_a_kept_id(tmp_path, capsys):
    """`moeflow down` signals a PID from `stack.json` only while it names the process `up --keep` started:
    after a reboot the same number names another process, which is left alone, and down says so."""
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)  # what now has the kept id
    try:
        home = tmp_path / "home"
        home.mkdir()
        reused = identity(other.pid).rsplit("/", 1)[0] + "/1"  # same boot, started at another time
        (home / "stack.json").write_text(json.dumps({
            "server": other.pid, "worker": other.pid, "identity": {"server": reused, "worker": reused},
            "ui": "http://127.0.0.1:1", "api": "http://127.0.0.1:1/api"}))
        assert main(["down", "--home", str(home)]) == 0
        time.sleep(0.5)
        assert other.poll() is None, "moeflow down killed a process that was not the one it had started"
        err = capsys.readouterr().err
        assert f"left process {other.pid} alone" in err and "different process now" in err
        assert not (home / "stack.json").exists()
        # the process it did start: stopped
        (home / "stack.json").write_text(json.dumps({
            "server": other.pid, "worker": other.pid,
            "identity": {"server": identity(other.pid), "worker": identity(other.pid)}, "ui": None, "api": None}))
        assert LocalStack.stop_kept(home)["skipped"] == []
        assert other.wait(timeout=10) == -signal.SIGTERM
    finally:
        other.kill()
        other.wait()


def test_a_pool_worker_killed_names_its_part_and_the_setting(prefect_server, smoke_data, tmp_path):
    """A shard task's pool process SIGKILLed (what the kernel's OOM killer does): the run fails saying which
    parts lost their process, that memory likely ran out, and which settings lower it."""
    killed: list[int] = []

    def kill_a_pool_worker() -> None:
        """Once the pool has both its processes, a second on (spawned, still importing: no part done yet), one
        goes."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if len(pool := [p for p in descendants(os.getpid()) if b"spawn_main" in _cmdline(p)]) == 2:
                time.sleep(1)
                os.kill(pool[0], signal.SIGKILL)
                killed.append(pool[0])
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_a_pool_worker, daemon=True)
    killer.start()
    _lose_both_ingest_parts(tmp_path)
    killer.join()
    assert killed


def test_a_pool_worker_killed_while_the_pool_starts_names_its_part(prefect_server, smoke_data, tmp_path,
                                                                   monkeypatch):
    """The first pool process SIGKILLed while the pool still spawns the second (the OOM killer can pick it
    there): the part being submitted fails in the executor, which closed its queues under it
    (OSError('handle is closed')), and the run says what died as above."""
    from concurrent.futures.process import ProcessPoolExecutor

    spawn, killed = ProcessPoolExecutor._spawn_process, []

    def kill_the_first_then_spawn(pool: ProcessPoolExecutor) -> None:
        if pool._processes and not killed:
            (first,) = pool._processes.values()
            os.kill(first.pid, signal.SIGKILL)
            killed.append(first.pid)
            deadline = time.monotonic() + 30
            while not pool._call_queue._reader.closed:  # the pool has seen it die: broken, its queues closing
                assert time.monotonic() < deadline, "the pool never saw its process die"
                time.sleep(0.01)
        spawn(pool)

    monkeypatch.setattr(ProcessPoolExecutor, "_spawn_process", kill_the_first_then_spawn)
    _lose_both_ingest_parts(tmp_path)
    assert killed


def _lose_both_ingest_parts(tmp_path: Path) -> None:
    """Run smoke to filter with two ingest parts on two pool processes, a test killing one before any part is
    done: the run fails naming both parts, that memory likely ran out, and which settings lower it."""
    from moeflow.flows.pretrain import pretrain

    path = write_config(tmp_path / "smoke.yaml", store=str(tmp_path / "store"),
                        execution={"shards": 2, "workers": 2})
    with pytest.raises(PoolProcessDied) as failed:
        pretrain(config=str(path), until="filter")
    message = str(failed.value)
    assert message.startswith("ingest[0/2], ingest[1/2]: a process of the shard pool was killed")  # none done yet
    assert "OOM killer: memory ran out" in message and "`execution.shards`" in message


def _ours(mark: str) -> list[str]:
    """The running processes whose environment carries `mark` (everything a test's command started)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark.encode() in environ.read_bytes().split(b"\0"):
                found.append(f"{environ.parent.name}: {(environ.parent / 'cmdline').read_bytes()[:200]!r}")
        except OSError:
            pass  # gone, or not ours to read
    return found


def _kill_left(found: list[str]) -> None:
    """SIGKILL what `_ours` found (a failing test leaves no stack behind)."""
    for line in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)


class _Command:
    """A moeflow command in a session of its own, as a terminal runs it; its output collected as it comes."""

    def __init__(self, args: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen([sys.executable, "-m", "moeflow.cli", *args], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def ctrl_c(self) -> None:
        """What a terminal's Ctrl-C does: SIGINT to the foreground process group."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def interrupt(self, sig: signal.Signals) -> None:
        """Ctrl-C, or SIGTERM as `kill PID` or a supervisor stopping the command sends it: to its process only."""
        if sig == signal.SIGINT:
            self.ctrl_c()
        else:
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> tuple[int, str]:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.reader.join(10)
            pytest.fail(f"the command did not exit within {timeout} s; its output:\n{''.join(self.lines)[-6000:]}")
        self.reader.join(10)
        return rc, "".join(self.lines)


def _await(what, timeout: float, why: str, command: _Command):
    deadline = time.monotonic() + timeout
    while not (found := what()):
        assert time.monotonic() < deadline and command.proc.poll() is None, f"{why}:\n{''.join(command.lines)}"
        time.sleep(0.2)
    return found


def _state_on_restarted_server(home: Path, run_id: str | None = None) -> tuple[str, str]:
    """The (flow run id, state type) the server on `home`'s database reports, the command's own server being
    gone: started again on that database."""
    stack = LocalStack(home).start_server("--no-services")
    try:
        if run_id is None:
            ask = urllib.request.Request(f"{stack.api_url}/flow_runs/filter", data=b"{}", method="POST",
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(ask, timeout=10) as r:
                (run,) = [f for f in json.load(r) if f["flow_id"] and not f["parent_task_run_id"]]
            run_id = run["id"]
        return run_id, stack.flow_run_state(run_id)
    finally:
        stack.stop()


def _up_past_ingest(tmp_path: Path) -> tuple[_Command, str, str]:
    """`moeflow up smoke` in a session of its own, once its flow run has finished ingest: (command, flow run
    id, the environment entry every process it starts carries)."""
    mark = f"MOEFLOW_STORE={tmp_path / 'store'}"
    up = _Command(["up", "smoke", "--home", str(tmp_path / "home")], {**os.environ, "MOEFLOW_STORE": mark[14:]})
    line = _await(lambda: next((x for x in up.lines if x.startswith("flow run: ")), None), 240,
                  "no flow run announced", up)
    _await(lambda: any("task-run.Completed * ingest" in x for x in up.lines), 240, "ingest never finished", up)
    return up, line.rsplit("/", 1)[1].strip(), mark


INTERRUPTS = pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])


@pytest.mark.e2e
@pytest.mark.check
@INTERRUPTS
def test_an_interrupt_on_up_cancels_the_flow_run_and_stops_server_and_worker(smoke_data, tmp_path, sig):
    """Ctrl-C or SIGTERM on `moeflow up smoke` while the flow runs: the run is cancelled through Prefect
    (Cancelled, as its server reports), no server, worker or flow run process is left, and the command exits
    128 + the signal's number (130, 143) saying so."""
    up, run_id, mark = _up_past_ingest(tmp_path)
    started = time.monotonic()
    up.interrupt(sig)
    rc, out = up.wait(timeout=240)
    print(f"exited {time.monotonic() - started:.1f} s after {sig.name}\n{out[-3000:]}")
    left = _ours(mark)
    _kill_left(left)
    assert left == [], f"still running after the command exited: {left}"
    assert rc == 128 + sig, out
    assert f"interrupted: flow run {run_id} cancelled; server and worker stopped" in out
    assert _state_on_restarted_server(tmp_path / "home", run_id) == (run_id, "CANCELLED")


@pytest.mark.e2e
@pytest.mark.check
def test_a_second_ctrl_c_on_up_kills_at_once(smoke_data, tmp_path):
    """A second Ctrl-C while `moeflow up` waits for the cancellation: server, worker and the flow run's
    processes are killed at once, exit 130."""
    up, _, mark = _up_past_ingest(tmp_path)
    up.ctrl_c()
    _await(lambda: any("interrupted; cancelling" in x for x in up.lines), 60, "no word of the interrupt", up)
    started = time.monotonic()
    up.ctrl_c()
    rc, out = up.wait(timeout=60)
    print(f"exited {time.monotonic() - started:.1f} s after the second Ctrl-C\n{out[-3000:]}")
    assert rc == 130 and "interrupted twice: killed what it had started" in out, out
    assert _ours(mark) == []


@pytest.mark.check
@INTERRUPTS
def test_an_interrupt_on_run_cancels_the_flow_run_and_stops_pool_and_server(smoke_data, tmp_path, sig):
    """Ctrl-C or SIGTERM on `moeflow run` while a sharded stage's pool works: the flow run ends Cancelled on the
    temporary server (which a Ctrl-C to the command's process group does not reach), and no pool or server
    process is left; exit 128 + the signal's number (130, 143)."""
    config = write_config(tmp_path / "smoke.yaml", store=str(tmp_path / "store"),
                          execution={"shards": 2, "workers": 2})
    mark = f"MOEFLOW_TEST_MARK={tmp_path}"
    env = {**os.environ, "MOEFLOW_TEST_MARK": str(tmp_path), "PREFECT_HOME": str(tmp_path / "home")}
    env.pop("PREFECT_API_URL", None)
    run = _Command(["run", str(config)], env)

    def pool() -> list[int]:
        return [p for p in descendants(run.proc.pid) if b"spawn_main" in _cmdline(p)]

    _await(pool, 240, "no pool process started", run)
    time.sleep(2)  # into the parts' work
    started = time.monotonic()
    run.interrupt(sig)
    rc, out = run.wait(timeout=120)
    print(f"exited {time.monotonic() - started:.1f} s after {sig.name}\n{out}")
    left = _ours(mark)
    _kill_left(left)
    assert left == [], f"still running after the command exited: {left}"
    assert rc == 128 + sig, out
    assert "cancelled; the temporary server is stopping" in out
    assert _state_on_restarted_server(tmp_path / "home")[1] == "CANCELLED"


def test_a_killed_run_leaves_no_temporary_server(tmp_path):
    """`moeflow run`'s temporary server runs in a session of its own (out of Ctrl-C's reach) yet ends with the
    command, even one SIGKILLed (as the OOM killer ends it), instead of serving on forever."""
    env = {**os.environ, "MOEFLOW_STORE": str(tmp_path / "store"), "PREFECT_HOME": str(tmp_path / "home")}
    env.pop("PREFECT_API_URL", None)
    run = _Command(["run", "smoke"], env)
    server = _await(lambda: next((p for p in descendants(run.proc.pid) if b"server\0start" in _cmdline(p)), None),
                    120, "no temporary server started", run)
    time.sleep(2)  # up and serving
    assert _alive(server)
    run.proc.kill()
    run.wait(timeout=10)
    deadline = time.monotonic() + 30
    while _alive(server):
        assert time.monotonic() < deadline, "the temporary server still runs 30 s after its moeflow run was killed"
        time.sleep(0.2)


@pytest.mark.check  # a temporary Prefect server of its own, started and stopped: the slower tier
def test_a_run_with_its_own_server_starts_no_other(smoke_data, tmp_path):
    """`moeflow run` without a configured server starts one and points every thread of the run at it: the
    process pool's message forwarder, which reads Prefect's process-wide settings, started a temporary server
    of its own (Prefect says "Starting temporary server"), which could outlive the run holding its output."""
    config = write_config(tmp_path / "smoke.yaml", store=str(tmp_path / "store"),
                          execution={"shards": 2, "workers": 2})
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "home")}
    env.pop("PREFECT_API_URL", None)
    done = subprocess.run([sys.executable, "-m", "moeflow.cli", "run", str(config), "--until", "dedup"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Starting temporary server" not in done.stdout + done.stderr
