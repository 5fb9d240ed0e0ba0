"""A real S3 API on 127.0.0.1 for the object-store tests: moto's server, started as its own process on a
free port and stopped by its PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """`moto_server` on a free port; `env` is what a client needs (credentials are moto's fakes)."""

    def __init__(self, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.env = {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "moeflow-test",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def start(self, timeout: float = 60) -> S3Server:
        exe = Path(sys.executable).with_name("moto_server")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited ({self.proc.returncode}); see {self.log}")
            try:
                urllib.request.urlopen(f"{self.url}/moto-api/", timeout=2)
                return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"moto_server did not answer on {self.url} within {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def bucket(self, name: str) -> str:
        """Create the bucket `name`; its URL."""
        import fsspec

        fs, _ = fsspec.url_to_fs(f"s3://{name}", endpoint_url=self.url)
        fs.mkdir(name)
        return f"s3://{name}"
