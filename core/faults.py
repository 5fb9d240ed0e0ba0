"""Deterministic fault injection for `make chaos`: SIGKILL this process group at a named point of one stage.

`MOEFLOW_FAULT=STAGE[.PHASE][:PART]@WHERE` arms one point. PHASE is a sharded stage's phase (`shard`,
`sign`, `pairs`, `clusters`, `encode`) or `join`; PART a part's index. WHERE is one of
- `inputs`: the inputs verified, the body not started;
- `half`, or a fraction such as `0.37`: that far through the body's records (documents read, ingest's
  bytes, training steps; a seeded test draws the fraction);
- `written`: the body has written its files, no manifest yet;
- `publish`: in the store's commit: sealed in staging (local), or its data uploaded and no manifest written
  (object store);
- `committed`: the artifact is published, the run has not recorded it.
At the point the process prints what it kills, then SIGKILLs its own process group (the run and its pool
workers); `MOEFLOW_FAULT_SCOPE=process` kills only this process (a Ray or Dask worker mid-part), and
`MOEFLOW_FAULT_ONCE=FILE` fires only where FILE does not exist yet, creating it (so a retried part runs).
Unset (the default), the variable is read once per build and every point is one comparison.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

ENV, SCOPE_ENV, ONCE_ENV = "MOEFLOW_FAULT", "MOEFLOW_FAULT_SCOPE", "MOEFLOW_FAULT_ONCE"
NAMED = ("inputs", "written", "publish", "committed")
_SPEC = re.compile(r"^(?P<stage>[a-z_]+)(\.(?P<phase>[a-z_]+))?(:(?P<part>\d+))?@(?P<where>[a-z]+|0?\.\d+)$")


@dataclass(frozen=True)
class Fault:
    stage: str
    phase: str | None
    part: int | None
    where: str  # a named point, or "fraction"
    fraction: float | None = None


@functools.cache
def parse(text: str) -> Fault:
    m = _SPEC.match(text.strip())
    if m is None or m["where"] not in (*NAMED, "half") and m["where"][0] not in "0.":
        raise ValueError(f"{ENV}={text!r}: expected STAGE[.PHASE][:PART]@WHERE, WHERE one of "
                         f"{', '.join(NAMED)}, half or a fraction in (0, 1), e.g. dedup.sign:0@half")
    where = m["where"]
    fraction = 0.5 if where == "half" else float(where) if where[0] in "0." else None
    if fraction is not None and not 0 < fraction < 1:
        raise ValueError(f"{ENV}={text!r}: the fraction must be in (0, 1)")
    part = int(m["part"]) if m["part"] is not None else None
    return Fault(m["stage"], m["phase"], part, "fraction" if fraction is not None else where, fraction)


_armed: Fault | None = None  # the fault armed for what this process builds now


@contextmanager
def building(stage: str, phase: str | None = None, part: int | None = None) -> Iterator[None]:
    """Mark what this process is building (the runner does, around a stage's or a part's build): the
    variable is read here, once, and the points inside see whether it names this build."""
    global _armed
    before, _armed = _armed, _matching(stage, phase, part)
    try:
        yield
    finally:
        _armed = before


def _matching(stage: str, phase: str | None, part: int | None) -> Fault | None:
    text = os.environ.get(ENV)
    if not text:
        return None
    f = parse(text)
    if f.stage != stage or f.phase not in (None, phase) or f.part not in (None, part):
        return None
    return f


def at(point: str) -> None:
    """A named point: kill here when it is the armed one."""
    if _armed is not None and _armed.where == point:
        _kill(point)


def reached(done: float, total: float) -> None:
    """The body has done `done` of `total` records: kill here when that passes the armed fraction."""
    f = _armed
    if f is not None and f.fraction is not None and total > 0 and done >= f.fraction * total:
        _kill(f"{done:g} of {total:g} ({f.fraction:g})")


def _kill(where: str) -> None:
    once = os.environ.get(ONCE_ENV)
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # fired already: this is the retry
    whole = os.environ.get(SCOPE_ENV, "group") != "process"
    sys.stderr.write(f"{ENV}={os.environ[ENV]}: SIGKILL to {'process group' if whole else 'process'} "
                     f"{os.getpgrp() if whole else os.getpid()} at {where}\n")
    sys.stderr.flush()
    if whole:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
