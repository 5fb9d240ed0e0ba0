"""`core.faults`: a named kill point fires exactly where it is armed, in a real stage build, and nowhere
else; unset, it does nothing at all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from moeflow.core import faults

BUILD = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from helpers import docs_artifact, stage_config
from moeflow.tasks.runner import materialize
store = Path(sys.argv[1])
docs = docs_artifact(store, Path(sys.argv[2]))
m = materialize("dedup", stage_config(store, 2), {{"docs": docs}})
print("built", m.path)
"""


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    from moeflow.core.documents import DocWriter

    folder = tmp_path_factory.mktemp("docs")
    with DocWriter(folder, rows_per_group=10) as w:
        for i in range(60):
            w.write({"id": f"d{i:03d}", "source": "s", "domain": "d", "path": "p",
                     "text": f"document {i} " + "words that repeat " * (5 + i % 7)})
    return folder


def _build(tmp_path: Path, docs: Path, spec: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != faults.ENV} | ({faults.ENV: spec} if spec else {})
    script = BUILD.format(tests=str(Path(__file__).parent))
    return subprocess.run([sys.executable, "-c", script, str(tmp_path / "store"), str(docs)], env=env,
                          capture_output=True, text=True, timeout=300, start_new_session=True)


def _published(store: Path, stage: str) -> set[str]:
    return {p.name for p in (store / stage).glob(f"{stage}-*")} if (store / stage).exists() else set()


@pytest.mark.parametrize("spec,published", [
    ("dedup.sign:1@inputs", {"dedup.sign"}),  # part 0 of two was built first
    ("dedup.sign:0@half", set()),
    ("dedup.pairs@written", {"dedup.sign"}),
    ("dedup.join@written", {"dedup.sign", "dedup.pairs", "dedup.clusters"}),
    ("dedup.clusters@publish", {"dedup.sign", "dedup.pairs"}),  # sealed in staging, never renamed in
    ("dedup.clusters@committed", {"dedup.sign", "dedup.pairs", "dedup.clusters"}),
])
def test_a_stage_is_killed_at_its_armed_point_and_nowhere_else(tmp_path, docs, spec, published):
    proc = _build(tmp_path, docs, spec)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr[-3000:]
    assert f"{faults.ENV}={spec}: SIGKILL to process group" in proc.stderr
    store = tmp_path / "store"
    made = {stage for stage in ("dedup.sign", "dedup.pairs", "dedup.clusters", "dedup") if _published(store, stage)}
    assert made == published
    if spec.startswith("dedup.sign:1"):
        assert len(_published(store, "dedup.sign")) == 1  # part 0 only


def test_a_point_armed_for_another_stage_changes_nothing(tmp_path, docs):
    plain = _build(tmp_path / "a", docs, None)
    other = _build(tmp_path / "b", docs, "filter@half")
    assert plain.returncode == other.returncode == 0, other.stderr[-3000:]
    names = [_published(tmp_path / x / "store", "dedup") for x in ("a", "b")]
    assert names[0] == names[1] and len(names[0]) == 1  # the same key, so the same artifact name
    files = [sorted((tmp_path / x / "store" / "dedup" / next(iter(names[0]))).iterdir()) for x in ("a", "b")]
    assert [f.name for f in files[0]] == [f.name for f in files[1]]
    for a, b in zip(*files, strict=True):
        if a.name == "manifest.json":  # (it names its folder; lineage.json holds times)
            ma, mb = (json.loads(f.read_text()) for f in (a, b))
            assert (ma["files"], ma["stats"], ma["content_hash"]) == (mb["files"], mb["stats"], mb["content_hash"])
        elif a.name != "lineage.json":
            assert a.read_bytes() == b.read_bytes(), a.name


def test_unset_every_point_returns_before_parsing_anything(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    faults.parse.cache_clear()
    with faults.building("dedup", "sign", 0):
        monkeypatch.setenv(faults.ENV, "dedup@inputs")  # read once, when the build began: not armed
        for i in range(1000):
            faults.at("inputs")
            faults.reached(i, 10)
    assert faults.parse.cache_info().misses == 0


@pytest.mark.parametrize("bad", ["dedup", "dedup@later", "dedup@1.5", "dedup@0", "Dedup@half", "dedup.sign:x@half"])
def test_a_malformed_spec_names_the_variable_and_the_form(bad):
    with pytest.raises(ValueError, match=r"MOEFLOW_FAULT=.*(STAGE\[\.PHASE\]\[:PART\]@WHERE|fraction must be)"):
        faults.parse(bad)
