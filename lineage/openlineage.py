"""OpenLineage run events (START, COMPLETE) for each stage run that builds an artifact.

By default the events go to `<store>/openlineage/events.jsonl` through the client's file transport.
Where the OpenLineage client is configured (OPENLINEAGE_URL, OPENLINEAGE_CONFIG or
`OPENLINEAGE__TRANSPORT__*` variables), the client's own configuration picks the backend instead
(Marquez, an HTTP endpoint, Kafka, ...). Datasets are artifact folders in the store's namespace.
"""

from __future__ import annotations

import os
from pathlib import Path

from openlineage.client import OpenLineageClient
from openlineage.client.event_v2 import InputDataset, Job, OutputDataset, Run, RunEvent, RunState
from openlineage.client.transport.file import FileConfig, FileTransport
from openlineage.client.uuid import generate_new_uuid

from moeflow import __version__

PRODUCER = f"https://pypi.org/project/moeflow/{__version__}"
NAMESPACE = "moeflow"


def events_path(store: Path) -> Path:
    return Path(store) / "openlineage" / "events.jsonl"


def _client(store: Path) -> OpenLineageClient:
    if any(
        k == "OPENLINEAGE_URL" or k == "OPENLINEAGE_CONFIG" or k.startswith("OPENLINEAGE__")
        for k in os.environ
    ):
        return OpenLineageClient()
    path = events_path(store)
    path.parent.mkdir(parents=True, exist_ok=True)
    return OpenLineageClient(transport=FileTransport(FileConfig(log_file_path=str(path), append=True)))


def emit(store: Path, lineage: dict) -> None:
    """Emit START and COMPLETE for the stage run recorded in `lineage` (its artifact now committed)."""
    art = lineage["artifact"]
    data_ns = f"file://{Path(store).resolve()}"
    run = Run(runId=lineage["prefect"].get("task_run_id") or str(generate_new_uuid()))
    job = Job(namespace=NAMESPACE, name=lineage["stage"])
    inputs = [InputDataset(namespace=data_ns, name=v["path"]) for _, v in sorted(lineage["inputs"].items())]
    outputs = [OutputDataset(namespace=data_ns, name=f"{art['stage']}/{art['stage']}-{art['hash']}")]
    client = _client(store)
    for state, when in ((RunState.START, lineage["started_at"]), (RunState.COMPLETE, lineage["finished_at"])):
        client.emit(
            RunEvent(
                eventType=state,
                eventTime=when,
                run=run,
                job=job,
                producer=PRODUCER,
                inputs=inputs,
                outputs=outputs,
            )
        )
