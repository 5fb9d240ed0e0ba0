"""Build locks on object storage: lease objects made with create-if-absent, renewed by a heartbeat.

A lease lives under `<prefix>/`, one object per generation (`000000000007`), holding its holder and
expiry. To take it, a writer lists the generations: when the newest is released or expired (or
there is none), it creates the next one with an atomic create-if-absent (S3's `If-None-Match: *`
through fsspec's `mode="create"`); of two writers racing, one create fails and that one waits. The
holder rewrites its own generation every third of the lease time; a holder that dies stops, and
its lease lapses after `MOEFLOW_LEASE_SECONDS` (default 60). Expiry compares wall clocks, so the
nodes' clocks must agree to well within that. A holder that finds a newer generation (it paused
past its expiry) has lost the lease: `check()` raises, and it publishes nothing. A backend that
cannot create atomically is named and allowed only one writer: a live lease there is an error.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import PurePosixPath

from moeflow.store.format import ArtifactError

log = logging.getLogger(__name__)
_ATOMIC: dict[str, bool] = {}  # fsspec protocol -> whether create-if-absent is atomic


def lease_seconds() -> float:
    return float(os.environ.get("MOEFLOW_LEASE_SECONDS", 60))


def atomic_create(fs, probe_dir: str) -> bool:
    """Whether `fs` refuses to create an object that exists (probed once per protocol)."""
    proto = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if proto not in _ATOMIC:
        probe = f"{probe_dir}/.probe-{uuid.uuid4().hex}"
        fs.pipe_file(probe, b"0", mode="create")
        try:
            fs.pipe_file(probe, b"1", mode="create")
            _ATOMIC[proto] = False
        except FileExistsError:
            _ATOMIC[proto] = True
        finally:
            fs.rm(probe)
        if not _ATOMIC[proto]:
            log.warning("the %s backend cannot create objects atomically: moeflow refuses a second writer "
                        "of an artifact there instead of waiting for it", proto)
    return _ATOMIC[proto]


class Lease:
    """`with Lease(fs, prefix):` holds the lease at `prefix` (waiting while a live holder has it)."""

    def __init__(self, fs, prefix: str, seconds: float | None = None):
        self.fs, self.prefix = fs, prefix
        self.seconds = seconds or lease_seconds()
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "id": uuid.uuid4().hex}
        self.gen: int | None = None
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def __enter__(self) -> Lease:
        atomic = atomic_create(self.fs, PurePosixPath(self.prefix).parent.as_posix())
        said = False
        while not self._try(atomic):
            if not said:
                log.info("waiting for the build lease %s (held by another writer)", self.prefix)
                said = True
            time.sleep(min(1.0, self.seconds / 10))
        self._beat = threading.Thread(target=self._heartbeat, daemon=True, name=f"lease {self.prefix}")
        self._beat.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        if not self.lost.is_set():
            self._write(self.gen, released=True)

    def _generations(self) -> list[str]:
        try:
            names = self.fs.ls(self.prefix, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if PurePosixPath(n).name.isdigit())

    def _state(self, path: str) -> dict | None:
        try:
            return json.loads(self.fs.cat_file(path))
        except FileNotFoundError:
            return None

    def _try(self, atomic: bool) -> bool:
        gens = self._generations()
        top = self._state(gens[-1]) if gens else None
        if top is not None and not top.get("released") and top["expires"] > time.time():
            if not atomic:
                raise ArtifactError(f"{self.prefix} is held by {top['host']} pid {top['pid']}, and this "
                                    "backend cannot create objects atomically: run one writer at a time")
            return False
        self.gen = int(PurePosixPath(gens[-1]).name) + 1 if gens else 0
        try:
            self._write(self.gen, create=True)
        except FileExistsError:
            return False
        for old in gens[:-1]:  # generations below the one just passed over are history
            self.fs.rm(old)
        return True

    def _write(self, gen: int, create: bool = False, released: bool = False) -> None:
        body = {**self.me, "expires": time.time() + self.seconds, "released": released}
        self.fs.pipe_file(f"{self.prefix}/{gen:012d}", json.dumps(body).encode(),
                          mode="create" if create else "overwrite")

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.seconds / 3):
            gens = self._generations()
            if gens and int(PurePosixPath(gens[-1]).name) > self.gen:
                self.lost.set()
                log.warning("lost the build lease %s: another writer took it after it lapsed", self.prefix)
                return
            self._write(self.gen)

    def check(self) -> None:
        """Raise if the lease was lost (the holder must not publish)."""
        gens = self._generations()
        if self.lost.is_set() or (gens and int(PurePosixPath(gens[-1]).name) > self.gen):
            raise ArtifactError(f"lost the build lease {self.prefix} (it lapsed while this writer paused); "
                                "nothing was published: run again")
