"""Build locks on object storage: lease objects made with create-if-absent, renewed by a heartbeat.

A lease lives under `<prefix>/`, one object per generation (`000000000007`), holding its holder and
expiry. To take it, a writer lists the generations: when the newest is released or expired (or
there is none), it creates the next one with an atomic create-if-absent (S3's `If-None-Match: *`
through fsspec's `mode="create"`); of two writers racing, one create fails and that one waits. The
holder rewrites its own generation every third of the lease time; a holder that dies stops, and
its lease lapses after `MOEFLOW_LEASE_SECONDS` (default 60). Expiry compares wall clocks, so the
nodes' clocks must agree to well within that. A renewal that fails (a network blip, throttling) is
logged and retried with backoff while the lease is still valid; once it has expired unrenewed, or a
holder finds a newer generation (it paused past its expiry), the lease is lost: `LeaseLost` is
raised in the thread that holds it at once (its build stops within a step, not hours later at
publish), `check()` raises, and it publishes nothing. Publishing itself is a conditional write
(`put_if`), so even a holder that loses its lease between `check()` and the write cannot commit over
another writer's manifest. A backend that cannot create atomically is named and allowed only one
writer: a live lease there is an error.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import PurePosixPath

import xxhash

from moeflow.store.format import ArtifactError

log = logging.getLogger(__name__)
_ATOMIC: dict[str, bool] = {}  # fsspec protocol -> whether create-if-absent is atomic


def lease_seconds() -> float:
    return float(os.environ.get("MOEFLOW_LEASE_SECONDS", 60))


class LeaseLost(ArtifactError):
    """This writer's build lease lapsed or was taken: what it builds must not be published."""


_WHY: dict[int, str] = {}  # thread id -> why its lease was lost (an async exception is raised as a class)


class _LostHere(LeaseLost):
    """`LeaseLost` as raised in the holder's thread from the heartbeat's."""

    def __init__(self, message: str | None = None):
        super().__init__(message or _WHY.get(threading.get_ident(), "lost the build lease"))


class Superseded(ArtifactError):
    """A conditional write found the object changed since the writer read it."""


def _protocol(fs) -> str:
    return fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]


def version(fs, path: str) -> str | None:
    """The object's version: its ETag where the backend has one, else its content's xxh3; None when absent."""
    try:
        info = fs.info(path, refresh=True)
        return info.get("ETag") or xxhash.xxh3_64_hexdigest(fs.cat_file(path))
    except FileNotFoundError:
        return None


def put_if(fs, path: str, data: bytes, base: str | None) -> None:
    """Write `data` at `path` only if the object is still at version `base` (None: still absent), else raise
    `Superseded`. On S3 one request does it (`If-None-Match: *` / `If-Match: <etag>`); on a backend without
    conditional overwrites it compares, then writes (such backends take one writer: see `atomic_create`)."""
    try:
        if base is None:
            fs.pipe_file(path, data, mode="create")
        elif _protocol(fs) in ("s3", "s3a"):
            fs.pipe_file(path, data, IfMatch=base)
        elif version(fs, path) != base:
            raise Superseded(f"{path} changed")
        else:
            fs.pipe_file(path, data)
    except FileExistsError:
        raise Superseded(f"{path} exists") from None
    except OSError as e:
        code = getattr(e.__cause__, "response", {}).get("Error", {}).get("Code")
        if e.errno == errno.EINVAL and code == "PreconditionFailed":
            raise Superseded(f"{path} changed") from None
        raise


def atomic_create(fs, probe_dir: str) -> bool:
    """Whether `fs` refuses to create an object that exists (probed once per protocol)."""
    proto = _protocol(fs)
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
        self.expires = 0.0  # when the generation this holder last wrote lapses (its wall clock)
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._holder: int | None = None  # the thread that entered: told at once when the lease is lost
        self._guard = threading.Lock()

    def __enter__(self) -> Lease:
        atomic = atomic_create(self.fs, PurePosixPath(self.prefix).parent.as_posix())
        said = False
        while not self._try(atomic):
            if not said:
                log.info("waiting for the build lease %s (held by another writer)", self.prefix)
                said = True
            time.sleep(min(1.0, self.seconds / 10))
        self._holder = threading.get_ident()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True, name=f"lease {self.prefix}")
        self._beat.start()
        return self

    def settle(self) -> None:
        """The holder is about to publish: no `LeaseLost` is raised in its thread from here (a write cut
        half-way could not be told from one that landed); `check()` and the conditional write decide."""
        with self._guard:
            if self._holder is not None:  # one raised but not yet delivered is dropped
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._holder), None)
                self._holder = None

    def __exit__(self, *exc) -> None:
        self.settle()
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        if not self.lost.is_set():
            with contextlib.suppress(Exception):  # unreleased, it lapses on its own
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

    def holder(self, gens: list[str] | None = None) -> dict | None:
        """The live holder's record (host, pid, expiry), None when the lease is free."""
        gens = self._generations() if gens is None else gens
        top = self._state(gens[-1]) if gens else None
        return top if top is not None and not top.get("released") and top["expires"] > time.time() else None

    def _try(self, atomic: bool) -> bool:
        gens = self._generations()
        if (top := self.holder(gens)) is not None:
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
        self.expires = body["expires"]

    def _heartbeat(self) -> None:
        """Renew every third of the lease time; a failed renewal is retried with backoff (0.5 s, doubling, at
        most a third of the lease time or half the time it has left) while the lease is valid, each logged."""
        wait, failures = self.seconds / 3, 0
        while not self._stop.wait(wait):
            try:
                gens = self._generations()
                if gens and int(PurePosixPath(gens[-1]).name) > self.gen:
                    return self._lose("another writer took it after it lapsed")
                self._write(self.gen)
                wait, failures = self.seconds / 3, 0
            except Exception as e:  # noqa: BLE001 - any failed request: retried, then the lease is lost
                failures += 1
                left = self.expires - time.time()
                if left <= 0:
                    return self._lose(f"{failures} renewals failed, the last: {type(e).__name__}: {e}")
                wait = min(0.5 * 2 ** (failures - 1), self.seconds / 3, max(left / 2, 0.05))
                log.warning("renewing the build lease %s failed (%s: %s); retrying in %.1f s, it lapses in "
                            "%.0f s", self.prefix, type(e).__name__, e, wait, left)

    def _lose(self, why: str) -> None:
        """Mark the lease lost and raise `LeaseLost` in the holder's thread (its build stops there)."""
        message = (f"lost the build lease {self.prefix} ({why}); another writer may be building it: nothing "
                   "was published: run again (it reuses the artifact if the other writer publishes it)")
        log.error("%s", message)
        self.lost.set()
        with self._guard:
            if self._holder is not None:
                _WHY[self._holder] = message
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._holder),
                                                           ctypes.py_object(_LostHere))

    def check(self) -> None:
        """Raise if the lease was lost (the holder must not publish)."""
        gens = self._generations()
        if self.lost.is_set() or (gens and int(PurePosixPath(gens[-1]).name) > self.gen):
            raise LeaseLost(f"lost the build lease {self.prefix} (it lapsed while this writer paused); "
                                "nothing was published: run again")
