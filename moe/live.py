"""The live training table: the latest steps' health as markdown on the task run's Prefect page,
refreshed every `log_every` steps and at once when an alarm fires, with the TensorBoard command."""

from __future__ import annotations

from collections import deque
from pathlib import Path

from moeflow.core import progress

COLUMNS = ("step", "phase", "loss", "grad norm", "lr", "tokens/s", "MFU", "token drop",
           "imbalance per layer (max/mean)")


def _row(r: dict) -> list[str]:
    mfu = f"{r['mfu']:.2%}" if r.get("mfu") is not None else "unknown"
    imbalance = " ".join(f"{x:.2f}" for x in r["load_imbalance"]) or "no MoE layer"
    return [str(r["step"]), str(r["phase"]), f"{r['loss']:.4f}", f"{r['grad_norm']:.3f}", f"{r['lr']:.2e}",
            f"{r['tokens_per_s']:,.0f}", mfu, f"{r['token_drop_rate']:.2%}", imbalance]


class LiveTable:
    """The table for one training task run (`name`: `train`, `rung0`, ...)."""

    def __init__(self, name: str, steps: int, every: int, tensorboard: Path, rows: int = 12):
        self.name, self.steps, self.every, self.tensorboard = name, steps, every, tensorboard
        self.board = progress.Artifact("markdown", f"{name}-live")
        self.rows: deque[dict] = deque(maxlen=rows)
        self.alarms: list[dict] = []

    def step(self, record: dict, alarms: list[str]) -> None:
        """Take one step's record and the alarms it fired; show the table when it is due."""
        self.alarms += [{"step": record["step"], "alarm": a} for a in alarms]
        due = record["step"] % self.every == 0 or record["step"] == self.steps
        if due or alarms:
            self.rows.append(record)
            last = self.rows[-1]
            self.board.send(self.markdown(), f"{self.name}: step {last['step']} of {self.steps}, "
                            f"loss {last['loss']:.4f}, {len(self.alarms)} alarm(s)", force=True)

    def markdown(self) -> str:
        step = self.rows[-1]["step"]
        out = [f"### {self.name}: step {step:,} of {self.steps:,} ({step / self.steps:.0%})", "",
               "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        out += ["| " + " | ".join(_row(r)) + " |" for r in reversed(self.rows)]
        out += ["", f"**Alarms ({len(self.alarms)})**" if self.alarms else "**Alarms:** none so far."]
        out += [f"- step {a['step']}: {a['alarm']}" for a in self.alarms[-10:]]
        out += ["", "TensorBoard for this run (while it trains; the artifact's `tensorboard/` once it ends):",
                "", f"    tensorboard --logdir {self.tensorboard}"]
        return "\n".join(out)
