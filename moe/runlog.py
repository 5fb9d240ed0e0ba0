"""Where a training run's records go, in its work folder: `metrics.jsonl` (a line per step), `alarms.jsonl`,
TensorBoard event files under `tensorboard/`, the live table on the task run's Prefect page and the progress
bar. Rank 0 writes them; every rank keeps the alarms. A resumed run first drops the records of the steps
after its checkpoint: it computes them again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter

from moeflow.configs import TrainConfig
from moeflow.core import progress
from moeflow.core.progress import tqdm
from moeflow.moe import live, parallel
from moeflow.moe.alarms import Alarm
from moeflow.moe.metrics import Step

log = logging.getLogger(__name__)
SCALARS = ("loss", "ce", "load_balancing_loss", "sequence_balancing_loss", "router_z_loss", "grad_norm", "lr",
           "tokens_per_s", "token_drop_rate")  # of a step's record, to TensorBoard


def truncate_jsonl(path: Path, upto: int, world: parallel.World | None = None) -> tuple[list[dict], list[dict]]:
    """Keep the records of steps <= upto (a resumed run recomputes the rest); return them and the dropped ones.
    Under torchrun every rank reads them (for identical alarm decisions) before rank 0 rewrites the file."""
    records = list(map(json.loads, path.read_text().splitlines())) if path.exists() else []
    kept = [r for r in records if r["step"] <= upto]
    if world is not None:
        torch.distributed.barrier()
    if world is None or world.main:
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return kept, records[len(kept):]


class RunLog:
    """The records of one run; `kept` holds the steps a resumed run keeps (`resumed_at`: its checkpoint's
    step), `recomputed` those it drops to train again, `alarms` every alarm so far."""

    def __init__(self, work: Path, cfg: TrainConfig, world: parallel.World | None, resumed_at: int | None):
        self.cfg, self.main = cfg, world is None or world.main
        self.metrics_path, self.alarms_path = work / "metrics.jsonl", work / "alarms.jsonl"
        self.start = resumed_at or 0
        self.kept, self.recomputed = [], []
        if resumed_at is not None:
            self.kept, self.recomputed = truncate_jsonl(self.metrics_path, resumed_at, world)
        elif self.main:
            self.metrics_path.write_text("")
        self.alarms = truncate_jsonl(self.alarms_path, self.start, world)[0]
        self.tb = (
            SummaryWriter(str(work / "tensorboard"), purge_step=self.start + 1 if self.start else None)
            if self.main
            else None
        )
        self.name = progress.task_name("train")  # `rung0` for a ladder rung
        self.table = live.LiveTable(self.name, cfg.steps, cfg.log_every, work / "tensorboard") if self.main else None

    @contextmanager
    def steps(self) -> Iterator[RunLog]:
        """metrics.jsonl open for appending (on rank 0) and the progress bar, while the steps run."""
        with (
            open(self.metrics_path, "a") if self.main else nullcontext() as self.metrics,
            tqdm(
                total=self.cfg.steps, initial=self.start, desc=self.name, unit="step", mininterval=5,
                disable=not self.main,
            ) as self.bar,
        ):
            yield self

    def alarm(self, step: int, alarm: Alarm, action: str) -> None:
        """Record an alarm: its text, the rule that fired, its reading and its action (`log` or `stop`)."""
        self.alarms.append({"step": step, "alarm": alarm.text, "rule": alarm.rule, "reading": alarm.reading,
                            "action": action})
        if self.main:
            log.warning("train: step %d alarm %s (%s)", step, alarm.text, action)
            with open(self.alarms_path, "a") as f:
                f.write(json.dumps(self.alarms[-1]) + "\n")

    def step(self, s: Step, record: dict, alarms: list[str]) -> None:
        """The step's record and alarms; TensorBoard and the bar get the unrounded values."""
        if self.main:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()  # a killed run's metrics reach the last step it finished
            self.table.step(record, alarms)
            for key in SCALARS:
                self.tb.add_scalar(f"train/{key}", record[key], s.number)
            for i, x in enumerate(s.imbalance):
                self.tb.add_scalar(f"moe/load_imbalance_layer{i}", x, s.number)
        self.bar.update(1)
        if s.number % self.cfg.log_every == 0:
            self.bar.set_postfix(loss=f"{s.ce:.3f}", gnorm=f"{s.grad_norm:.2f}")

    def close(self) -> None:
        self.tb.close()
