"""Nothing read from a store runs code: no pickles, data formats only, no secrets in lineage or manifests."""

import json
import re
import shutil
from pathlib import Path

import numpy as np

from helpers import write_config
from moeflow.configs.quality import FASTTEXT_MAGIC
from moeflow.flows.pretrain import pretrain

ROOT = Path(__file__).resolve().parent.parent
DATA_SUFFIXES = {".parquet", ".arrow", ".json", ".jsonl", ".npz", ".safetensors", ".png", ".svg", ".md",
                 ".html", ".lock", ".bin"}  # .bin: a fastText model, read by fastText's own C++ loader (no pickle)
FAKE_SECRETS = ("AWS_SECRET_ACCESS_KEY", "MOEFLOW_TEST_API_TOKEN")  # set in conftest before any run


class _Planted:
    """Unpickling this creates `path`: what a writer to a shared store could plant for readers to run."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _plant(path: Path, marker: Path) -> None:
    """A result file in the format Prefect 3 persists task results in (cloudpickle behind JSON)."""
    from prefect.results import ResultRecord, ResultRecordMetadata
    from prefect.serializers import PickleSerializer

    meta = ResultRecordMetadata(storage_key=str(path), serializer=PickleSerializer(picklelib="cloudpickle"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(ResultRecord(metadata=meta, result=_Planted(marker)).serialize())


def test_a_planted_result_pickle_is_never_unpickled(smoke_run, tmp_path):
    from prefect.results import ResultRecord

    _, summary = smoke_run
    store = tmp_path / "store"
    shutil.copytree(summary["store"], store)
    marker = tmp_path / "ran-code-from-the-store"
    # where Prefect looked up a task's cached result: `<store>/.prefect-results/<stage>-<key>`
    planted = [store / ".prefect-results" / f"{label}-{s['hash']}" for label, s in summary["stages"].items()]
    for path in planted:
        _plant(path, marker)
    ResultRecord.deserialize(planted[0].read_bytes())  # the plant is live: Prefect's reader runs it
    assert marker.exists()
    marker.unlink()
    again = pretrain(config=str(write_config(tmp_path / "smoke.yaml", store=str(store))))
    assert all(s["reused"] for s in again["stages"].values())
    assert not marker.exists()


def _store_files(store: Path) -> list[Path]:
    return [p for p in store.rglob("*") if p.is_file() and ".prefect-results" not in p.parts]


def test_every_file_a_run_writes_to_the_store_is_data(smoke_run):
    _, summary = smoke_run
    files = _store_files(Path(summary["store"]))
    for path in files:
        tensorboard = path.name.startswith("events.out.tfevents.")
        assert path.suffix in DATA_SUFFIXES or tensorboard, path
        assert path.read_bytes()[:2] not in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05"), path
        if path.suffix == ".bin":  # a fastText model, nothing else
            assert path.read_bytes()[:4] == FASTTEXT_MAGIC, path
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as npz:
                assert all(npz[k].dtype != object for k in npz.files), path
    assert {p.suffix for p in files} >= {".parquet", ".arrow", ".npz", ".safetensors", ".json"}


def test_no_reader_in_the_package_can_load_a_pickle():
    """Every way Python and its numeric libraries read a pickle, searched in the package source."""
    unsafe = re.compile(r"\bpickle\b|cloudpickle|\bdill\b|joblib|\bshelve\b|\bmarshal\b|torch\.load\("
                        r"|allow_pickle=True|weights_only=False")
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", ".venv", "benchmarks") or "site-packages" in rel.parts:
            continue
        lines = enumerate(path.read_text().splitlines(), 1)
        found += [f"{rel}:{i}: {line.strip()}" for i, line in lines
                  if unsafe.search(line) or "np.load(" in line and "allow_pickle=False" not in line]
    assert found == []


def test_lineage_and_manifests_record_no_secret_from_the_environment(smoke_run):
    import os

    _, summary = smoke_run
    secrets = [os.environ[k].encode() for k in FAKE_SECRETS]
    assert all(len(s) > 10 for s in secrets)
    store = Path(summary["store"])
    leaks = [str(p) for p in _store_files(store) if any(s in p.read_bytes() for s in secrets)]
    assert leaks == []
    lineage = json.loads((Path(summary["stages"]["train"]["artifact"]) / "lineage.json").read_text())
    assert "environ" not in json.dumps(lineage).lower()
