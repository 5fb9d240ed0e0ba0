"""The train stage's torchrun launcher: one command per node runs `train.run` on every rank, rank 0 reports.

`torchrun(...)` writes the run's arguments to `<work>/launch.json`, starts
`python -m torch.distributed.run ... -m moeflow.moe.launch <work>/launch.json` (rendezvous on
127.0.0.1 unless `train.distributed.rdzv_endpoint` names another host), streams its output and returns
the summary rank 0 wrote. With `nnodes > 1` the same command must run on every node (the log shows it),
node 0 being the train stage's. The spec names the inputs as store artifacts, so each node reads the mix,
tokenizer and ladder through the store: a local store's folders (shared by the filesystem), or an object
store's, pulled into each node's own mirror and verified. On an object store the spec and the newest
checkpoint (with the metrics every rank replays on resume) are also kept in the store beside the work
folder (`<stage>/.<stage>-<hash>.work/`), which the command names by URL: a node other than node 0 resumes
from the checkpoint there, not from node 0's disk.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections import deque
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from moeflow.configs import ModelConfig, TrainConfig, TrainStageConfig
from moeflow.core import progress
from moeflow.moe import checkpoint, train
from moeflow.store.format import is_remote
from moeflow.store.local import Manifest
from moeflow.store.mirror import node_lock
from moeflow.store.remote import SharedFolder

log = logging.getLogger(__name__)
SPEC, RESULT = "launch.json", "launch-result.json"
REPLAYED = ("metrics.jsonl", "alarms.jsonl")  # what every rank reads on resume, beside the checkpoint
SHARE_EVERY_S = 30.0  # how often node 0 copies a newer checkpoint into an object store while training
_ERROR = re.compile(
    r"^\s*(?:\[rank\d+\]:\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception|Alarm)\b: .*)$"
)  # a rank's exception line


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(cfg: TrainConfig, spec: Path | str) -> list[str]:
    d = cfg.distributed
    endpoint = d.rdzv_endpoint
    if endpoint.endswith(":0"):
        endpoint = f"{endpoint[:-2]}:{free_port()}"
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={d.nproc_per_node}",
        f"--nnodes={d.nnodes}",
        f"--node-rank={d.node_rank}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        "--max-restarts=0",
        "-m",
        "moeflow.moe.launch",
        str(spec),
    ]


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the stage's process dies (torchrun then stops its ranks)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def stage(s: TrainStageConfig, inputs: dict, out: Path, work: Path) -> dict:
    """The `train` (and `rung`) stage's body.

    Runs in this process, or under torchrun when more ranks are asked for.
    """
    prediction = inputs.get("prediction")
    if s.train.distributed.world_size > 1:  # the ranks (on every node) read the artifacts themselves
        return torchrun(s.model, s.train, seed=s.seed, mix_dir=inputs["mix"], tokenizer_dir=inputs["tokenizer"],
                        out=out, work=work, ladder_dir=prediction, band_tolerance=s.band_tolerance)
    return train.run(
        s.model,
        s.train,
        seed=s.seed,
        mix_dir=inputs["mix"].dir,
        tokenizer_dir=inputs["tokenizer"].dir,
        out=out,
        work=work,
        ladder_dir=prediction.dir if prediction else None,
        band_tolerance=s.band_tolerance,
    )


def _ref(folder: Path | Manifest | None) -> dict | None:
    """How the spec names an input: an artifact's manifest (each node reads it through the store) or a folder."""
    if folder is None:
        return None
    return {"manifest": folder.to_dict()} if isinstance(folder, Manifest) else {"path": str(folder)}


def _dir(ref: dict | None) -> Path | None:
    """An input's folder on this node: an object store's artifact is pulled into this node's mirror."""
    if ref is None:
        return None
    return Manifest(**ref["manifest"]).dir if "manifest" in ref else Path(ref["path"])


def share_checkpoint(shared: SharedFolder, work: Path) -> None:
    """Node 0: make the store hold the newest checkpoint there is, in `work` or in the store (a node 0 that
    is not the last one starts from the store's), with the records every rank replays on resume."""
    root = work / "checkpoints"
    mine, theirs = checkpoint.latest(root), _stored(shared)
    if theirs is not None and (mine is None or theirs > mine.name):
        fetch_checkpoint(shared, work)
    elif mine is not None and mine.name != theirs:
        for name in REPLAYED:
            if (work / name).exists():
                shared.put(name)
        shared.put(f"checkpoints/{mine.name}", last=checkpoint.STATE)
        for old in shared.names("checkpoints"):
            if old != mine.name:
                shared.remove(f"checkpoints/{old}")


def fetch_checkpoint(shared: SharedFolder, work: Path) -> None:
    """`work` holds the store's newest checkpoint and the records beside it, and no other checkpoint."""
    newest = _stored(shared)
    if newest is None:
        return
    if checkpoint.latest(work / "checkpoints") != work / "checkpoints" / newest:
        shared.get(f"checkpoints/{newest}")
        for name in REPLAYED:
            with contextlib.suppress(FileNotFoundError):
                shared.fs.get_file(f"{shared.base}/{name}", str(work / name))
    for other in (work / "checkpoints").glob("step-*"):
        if other.name != newest:
            shutil.rmtree(other, ignore_errors=True)


def _stored(shared: SharedFolder) -> str | None:
    """The name of the store's newest complete checkpoint (its state file is uploaded last)."""
    done = [n for n in shared.names("checkpoints")
            if shared.fs.exists(f"{shared.base}/checkpoints/{n}/{checkpoint.STATE}")]
    return done[-1] if done else None


def torchrun(
    model_cfg: ModelConfig,
    cfg: TrainConfig,
    *,
    seed: int,
    mix_dir: Path | Manifest,
    tokenizer_dir: Path | Manifest,
    out: Path,
    work: Path,
    ladder_dir: Path | Manifest | None = None,
    band_tolerance: float = 0.05,
) -> dict:
    """Run `train.run` on every rank under torchrun; the summary rank 0 wrote. The inputs are folders (shared
    by the filesystem when nnodes > 1) or artifacts' manifests (each node reads them through the store)."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    shared = SharedFolder.of(work)  # None: a local store, shared (when nnodes > 1) by the filesystem
    spec, result = work / SPEC, work / RESULT
    result.unlink(missing_ok=True)
    if shared is not None:
        share_checkpoint(shared, work)  # before the spec: a node that reads the spec finds it
    spec.write_text(json.dumps({
        "model": model_cfg.model_dump(mode="json"), "train": cfg.model_dump(mode="json"), "seed": seed,
        "mix": _ref(mix_dir), "tokenizer": _ref(tokenizer_dir), "ladder": _ref(ladder_dir),
        "out": str(out), "work": str(work), "shared": shared.url if shared else None, "result": str(result),
        "band_tolerance": band_tolerance,
    }, indent=2))
    if shared is not None:
        shared.put(SPEC)
    cmd = command(cfg, f"{shared.url}/{SPEC}" if shared else spec)
    log.warning(
        "train: %d ranks over %d node(s); on this node: %s",
        cfg.distributed.world_size,
        cfg.distributed.nnodes,
        shlex.join(cmd),
    )
    returncode, tail = _stream(cmd, cfg, shared, work)
    if returncode != 0 or not result.exists():
        if shared is not None:
            share_checkpoint(shared, work)
        causes = [m.group(1) for m in map(_ERROR.match, tail) if m]
        raise RuntimeError(
            f"train: torchrun exited with status {returncode}"
            + (f": {causes[-1]}" if causes else "")
            + f" ({shlex.join(cmd)}); its last lines:\n"
            + "".join(tail)
        )
    if shared is not None:
        shared.remove()  # the artifact holds the final checkpoint
    return json.loads(result.read_text())


def _stream(cmd: list[str], cfg: TrainConfig, shared: SharedFolder | None, work: Path) -> tuple[int, deque[str]]:
    """Run torchrun in a process group of its own, its output echoed by a thread of its own (the last lines
    kept). This thread waits for it and, on an object store, shares a newer checkpoint every `SHARE_EVERY_S` (a
    node 0 lost now is replaced from the store's) without pausing the output; whatever ends the wait early
    (LeaseLost raised in this thread by the lease's heartbeat, Ctrl-C, a failed upload) stops torchrun's group
    first."""
    cores = os.cpu_count() or 1
    env = {**os.environ, **progress.child_env(),  # rank 0 updates this task run's progress and table
           "OMP_NUM_THREADS": str(max(1, cores // cfg.distributed.nproc_per_node))}
    tail: deque[str] = deque(maxlen=60)
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, process_group=0,
        preexec_fn=_die_with_parent,
    ) as proc:
        echo = threading.Thread(target=_echo, args=(proc.stdout, tail), daemon=True, name="torchrun output")
        echo.start()
        try:
            while True:
                try:  # a wait with a timeout polls, so an exception raised in this thread is seen at once
                    proc.wait(timeout=SHARE_EVERY_S)
                    break
                except subprocess.TimeoutExpired:
                    if shared is not None:
                        share_checkpoint(shared, work)
        except BaseException:
            _stop(proc)
            raise
        finally:
            echo.join()
    return proc.returncode, tail


def _echo(out, tail: deque[str]) -> None:
    for line in out:
        sys.stderr.write(line)
        tail.append(line)


def _stop(proc: subprocess.Popen, grace: float = 10) -> None:
    """SIGTERM torchrun's process group (torchrun stops its ranks), then SIGKILL what is left of it once torchrun
    has exited or after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)


def _this_node(spec: dict) -> tuple[Path, Path]:
    """`work` and `out` on this node. On an object store a node other than node 0 works in its own mirror,
    from the store's newest checkpoint (its ranks fetch it once), and writes no artifact (rank 0 does)."""
    if spec["shared"] is None or int(os.environ.get("GROUP_RANK", "0")) == 0:
        return Path(spec["work"]), Path(spec["out"])
    shared = SharedFolder(spec["shared"])
    shared.local.mkdir(parents=True, exist_ok=True)
    with node_lock(shared.local.with_name(f".{shared.local.name}.fetch")):
        fetch_checkpoint(shared, shared.local)
    return shared.local, Path(tempfile.mkdtemp(prefix="moeflow-launch-out-"))


def _read_spec(where: str) -> dict:
    """The launch spec: a file, or its URL in an object store."""
    if is_remote(where):
        import fsspec  # only a launch on an object store reads the spec through fsspec

        with fsspec.open(where, "rb") as f:
            return json.loads(f.read())
    return json.loads(Path(where).read_text())


@record  # a failing rank's exception is written where torchrun reports it as the root cause
def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    spec = _read_spec((argv or sys.argv[1:])[0])
    work, out = _this_node(spec)
    summary = train.run(
        ModelConfig(**spec["model"]),
        TrainConfig(**spec["train"]),
        seed=spec["seed"],
        mix_dir=_dir(spec["mix"]),
        tokenizer_dir=_dir(spec["tokenizer"]),
        out=out,
        work=work,
        ladder_dir=_dir(spec["ladder"]),
        band_tolerance=spec["band_tolerance"],
    )
    if summary is not None:
        tmp = Path(spec["result"] + ".tmp")
        tmp.write_text(json.dumps(summary))
        os.replace(tmp, spec["result"])
    if out != Path(spec["out"]):
        shutil.rmtree(out, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
