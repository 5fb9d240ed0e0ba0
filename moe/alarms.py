"""A run's health alarms: loss spikes and grad-norm jumps out of their recent band, a grad norm past its ceiling
or trending up and, given the ladder's prediction, a smoothed loss that stays outside the predicted band. Every
rank sees the same values, so every rank raises the same alarms (what each does: `AlarmConfig.action`).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from moeflow.configs import AlarmConfig
from moeflow.moe import ladder
from moeflow.moe.metrics import Step


@dataclass(frozen=True)
class Alarm:
    """One alarm: the rule that fired (a kind of `alarms.actions`), the reading it fired on, what it says."""

    rule: str
    reading: float
    text: str


class _Once:
    """A condition that alarms when it starts to hold, not at every step it goes on holding."""

    def __init__(self):
        self.held = False

    def __call__(self, holds: bool) -> bool:
        starts, self.held = holds and not self.held, holds
        return starts


class Monitor:
    """Alarms for loss spikes and grad-norm jumps against the band of the last `window` steps, and for a grad
    norm that crosses its ceiling or whose windowed mean crosses its trend factor (once per crossing)."""

    def __init__(self, cfg: AlarmConfig):
        self.cfg = cfg
        self.losses: deque[float] = deque(maxlen=cfg.window)
        self.norms: deque[float] = deque(maxlen=cfg.window)
        self.trend: deque[float] = deque(maxlen=2 * cfg.trend_window)  # the window before, then the last
        self.above_ceiling, self.trending = _Once(), _Once()

    def check(self, loss: float, grad_norm: float) -> list[Alarm]:
        cfg, alarms = self.cfg, []
        if len(self.losses) == cfg.window:
            median = statistics.median(self.losses)
            if loss > (1 + cfg.loss_spike) * median:
                alarms.append(Alarm("loss_spike", loss,
                                    f"loss_spike: {loss:.4f} > {(1 + cfg.loss_spike):.2f} x median {median:.4f}"))
            mean, std = statistics.fmean(self.norms), statistics.pstdev(self.norms)
            if grad_norm > max(mean + cfg.grad_norm_sigma * std, cfg.grad_norm_ratio * mean):
                alarms.append(Alarm("grad_norm", grad_norm, f"grad_norm: {grad_norm:.4f} > mean {mean:.4f} + "
                                    f"{cfg.grad_norm_sigma} x std {std:.4f}"))
        self.losses.append(loss)
        self.norms.append(grad_norm)
        self.trend.append(grad_norm)
        ceiling = cfg.grad_norm_ceiling
        if self.above_ceiling(ceiling is not None and grad_norm > ceiling):
            alarms.append(Alarm("grad_norm_ceiling", grad_norm,
                                f"grad_norm_ceiling: {grad_norm:.4f} > ceiling {ceiling}"))
        ratio = None
        if cfg.grad_norm_trend is not None and len(self.trend) == self.trend.maxlen:
            norms = list(self.trend)
            ratio = statistics.fmean(norms[cfg.trend_window:]) / statistics.fmean(norms[: cfg.trend_window])
        if self.trending(ratio is not None and ratio > cfg.grad_norm_trend):
            alarms.append(Alarm("grad_norm_trend", ratio, f"grad_norm_trend: the mean of the last "
                                f"{cfg.trend_window} steps is {ratio:.3f} x the {cfg.trend_window} before, "
                                f"> {cfg.grad_norm_trend}"))
        return alarms


class Alarms:
    """The monitor's alarms, and the ladder band's once warmup is over: the band alarms once `band_patience` of
    the last `band_of` smoothed steps are outside it, once per such stretch, not at every step of it."""

    def __init__(self, monitor: Monitor, band: ladder.Band | None, warmup_steps: int):
        self.monitor, self.band, self.warmup_steps = monitor, band, warmup_steps
        self.recent: deque[float] = deque(maxlen=ladder.SMOOTH)  # the band judges a smoothed loss
        cfg = monitor.cfg
        self.outside: deque[bool] = deque(maxlen=cfg.band_of or cfg.band_patience)  # the last steps, in or out
        self.out_of_band = _Once()

    def replay(self, records: list[dict]) -> None:
        """A resumed run's history: the records of the steps before its checkpoint, with whether each was outside
        the band (so a run resumed outside it does not alarm again for the same stretch)."""
        for rec in records:
            self.monitor.check(rec["ce"], rec["grad_norm"])
            self.recent.append(rec["ce"])
            self._out_long_enough(bool(rec.get("outside_ladder_band")))

    def _out_long_enough(self, outside: bool) -> bool:
        """Whether this step, outside the band or not, starts a stretch long enough to alarm."""
        self.outside.append(outside)
        return self.out_of_band(sum(self.outside) >= self.monitor.cfg.band_patience)

    def check(self, s: Step, record: dict) -> list[Alarm]:
        """The step's alarms; with a band, `record` gets the band and whether the run is outside it."""
        alarms = self.monitor.check(s.ce, s.grad_norm)
        self.recent.append(s.ce)
        if self.band is not None:
            record["ladder_band"] = self.band.at(s.number)
            smoothed = sum(self.recent) / len(self.recent)
            outside = self.band.check(s.number, smoothed) if s.number > self.warmup_steps else None
            record["outside_ladder_band"] = outside is not None
            if self._out_long_enough(outside is not None):  # a stretch can only start at a step outside
                k, n = self.monitor.cfg.band_patience, self.outside.maxlen
                alarms.append(Alarm("ladder_band", smoothed, outside if k == 1 else f"{outside} ({k} of the last {n})"))
        return alarms
