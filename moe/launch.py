"""The train stage's torchrun launcher: one command per node runs `train.run` on every rank, rank 0 reports.

`torchrun(...)` writes the run's arguments to `<work>/launch.json`, starts
`python -m torch.distributed.run ... -m moeflow.moe.launch <work>/launch.json` (rendezvous on
127.0.0.1 unless `train.distributed.rdzv_endpoint` names another host), streams its output and returns
the summary rank 0 wrote. With `nnodes > 1` the same command must run on every node (the log shows it);
a shared `work` folder (the artifact store) carries the arguments, checkpoints and the summary.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from collections import deque
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from moeflow.configs import ModelConfig, TrainConfig, TrainStageConfig
from moeflow.core import progress
from moeflow.moe import train

log = logging.getLogger(__name__)
SPEC, RESULT = "launch.json", "launch-result.json"
_ERROR = re.compile(
    r"^\s*(?:\[rank\d+\]:\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception|Alarm)\b: .*)$"
)  # a rank's exception line


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(cfg: TrainConfig, spec: Path) -> list[str]:
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
    run = torchrun if s.train.distributed.world_size > 1 else train.run
    prediction = inputs.get("prediction")
    return run(
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


def torchrun(
    model_cfg: ModelConfig,
    cfg: TrainConfig,
    *,
    seed: int,
    mix_dir: Path,
    tokenizer_dir: Path,
    out: Path,
    work: Path,
    ladder_dir: Path | None = None,
    band_tolerance: float = 0.05,
) -> dict:
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    spec, result = work / SPEC, work / RESULT
    result.unlink(missing_ok=True)
    spec.write_text(
        json.dumps(
            {
                "model": model_cfg.model_dump(mode="json"),
                "train": cfg.model_dump(mode="json"),
                "seed": seed,
                "mix_dir": str(mix_dir),
                "tokenizer_dir": str(tokenizer_dir),
                "out": str(out),
                "work": str(work),
                "result": str(result),
                "ladder_dir": str(ladder_dir) if ladder_dir else None,
                "band_tolerance": band_tolerance,
            },
            indent=2,
        )
    )
    cmd = command(cfg, spec)
    log.warning(
        "train: %d ranks over %d node(s); on this node: %s",
        cfg.distributed.world_size,
        cfg.distributed.nnodes,
        shlex.join(cmd),
    )
    cores = os.cpu_count() or 1
    env = {**os.environ, **progress.child_env(),  # rank 0 updates this task run's progress and table
           "OMP_NUM_THREADS": str(max(1, cores // cfg.distributed.nproc_per_node))}
    tail: deque[str] = deque(maxlen=60)
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, preexec_fn=_die_with_parent
    ) as proc:
        for line in proc.stdout:
            sys.stderr.write(line)
            tail.append(line)
    if proc.returncode != 0 or not result.exists():
        causes = [m.group(1) for m in map(_ERROR.match, tail) if m]
        raise RuntimeError(
            f"train: torchrun exited with status {proc.returncode}"
            + (f": {causes[-1]}" if causes else "")
            + f" ({shlex.join(cmd)}); its last lines:\n"
            + "".join(tail)
        )
    return json.loads(result.read_text())


@record  # a failing rank's exception is written where torchrun reports it as the root cause
def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    spec = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    ladder_dir = Path(spec["ladder_dir"]) if spec["ladder_dir"] else None
    summary = train.run(
        ModelConfig(**spec["model"]),
        TrainConfig(**spec["train"]),
        seed=spec["seed"],
        mix_dir=Path(spec["mix_dir"]),
        tokenizer_dir=Path(spec["tokenizer_dir"]),
        out=Path(spec["out"]),
        work=Path(spec["work"]),
        ladder_dir=ladder_dir,
        band_tolerance=spec["band_tolerance"],
    )
    if summary is not None:
        tmp = Path(spec["result"] + ".tmp")
        tmp.write_text(json.dumps(summary))
        os.replace(tmp, spec["result"])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
