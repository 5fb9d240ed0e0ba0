"""A run's health alarms: loss spikes and grad-norm jumps out of their recent band and, given the ladder's
prediction, a smoothed loss that leaves the predicted band. Every rank sees the same values, so every
rank raises the same alarms.
"""

from __future__ import annotations

import statistics
from collections import deque

from moeflow.configs import AlarmConfig
from moeflow.moe import ladder
from moeflow.moe.metrics import Step


class Monitor:
    """Alarms for loss spikes and grad-norm jumps against the band of the last `window` steps."""

    def __init__(self, cfg: AlarmConfig):
        self.cfg = cfg
        self.losses: deque[float] = deque(maxlen=cfg.window)
        self.norms: deque[float] = deque(maxlen=cfg.window)

    def check(self, loss: float, grad_norm: float) -> list[str]:
        alarms = []
        if len(self.losses) == self.cfg.window:
            median = statistics.median(self.losses)
            if loss > (1 + self.cfg.loss_spike) * median:
                alarms.append(
                    f"loss_spike: {loss:.4f} > {(1 + self.cfg.loss_spike):.2f} x median {median:.4f}"
                )
            mean, std = statistics.fmean(self.norms), statistics.pstdev(self.norms)
            if grad_norm > max(mean + self.cfg.grad_norm_sigma * std, self.cfg.grad_norm_ratio * mean):
                alarms.append(
                    f"grad_norm: {grad_norm:.4f} > mean {mean:.4f} + "
                    f"{self.cfg.grad_norm_sigma} x std {std:.4f}"
                )
        self.losses.append(loss)
        self.norms.append(grad_norm)
        return alarms


class Alarms:
    """The monitor's alarms, and the ladder band's once warmup is over. Leaving the band raises one alarm,
    not one at every step outside it."""

    def __init__(self, monitor: Monitor, band: ladder.Band | None, warmup_steps: int):
        self.monitor, self.band, self.warmup_steps = monitor, band, warmup_steps
        self.recent: deque[float] = deque(maxlen=ladder.SMOOTH)  # the band judges a smoothed loss
        self.was_outside = False

    def replay(self, records: list[dict]) -> None:
        """A resumed run's history: the records of the steps before its checkpoint, and whether the last was
        outside the band (so a run resumed outside it does not alarm again for the same stretch)."""
        for rec in records:
            self.monitor.check(rec["ce"], rec["grad_norm"])
            self.recent.append(rec["ce"])
            self.was_outside = bool(rec.get("outside_ladder_band"))

    def check(self, s: Step, record: dict) -> list[str]:
        """The step's alarms; with a band, `record` gets the band and whether the run is outside it."""
        alarms = self.monitor.check(s.ce, s.grad_norm)
        self.recent.append(s.ce)
        if self.band is not None:
            record["ladder_band"] = self.band.at(s.number)
            smoothed = sum(self.recent) / len(self.recent)
            outside = self.band.check(s.number, smoothed) if s.number > self.warmup_steps else None
            record["outside_ladder_band"] = outside is not None
            if outside and not self.was_outside:
                alarms.append(outside)
            self.was_outside = outside is not None
        return alarms
