"""Sources read through Hugging Face `datasets`, offline: a dataset saved with `save_to_disk`
(`format: hf_dataset`) and local files loaded by a `datasets` builder, streamed (`format: hf_files`)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from moeflow.configs import Format, SourceConfig
from moeflow.ingest import lines
from moeflow.ingest.errors import ReadError, SourceError

# never the Hub: set before `datasets` is first imported (it reads them once)
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # `user/name` or `name`, as the Hub spells them
BATCH = 1024


def hub_hint(src: SourceConfig) -> str:
    """The message for a `path` that is not on this machine, when it reads like a Hub dataset name."""
    if src.format not in (Format.hf_dataset, Format.hf_files) or not HUB_NAME.match(src.path):
        return ""
    return (f"; {src.path!r} reads like a Hugging Face Hub name, and moeflow never downloads: on a machine "
            f"with access run `datasets.load_dataset({src.path!r}).save_to_disk(DIR)`, copy DIR here and "
            "point `path` at it (`format: hf_dataset`)")


def saved_files(src: SourceConfig, path: Path) -> tuple[Path, list[Path]]:
    """A saved dataset's folder and the Arrow files of its split (a `DatasetDict` needs `split:`), in
    order; a clear error for anything that is not a `save_to_disk` folder."""
    where = f"source {src.name!r}: {str(path)!r}"
    if not path.is_dir():
        raise SourceError(f"{where} is not a folder" + hub_hint(src))
    folder = path
    if (path / "dataset_dict.json").exists():
        splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        if src.split not in splits:
            raise SourceError(f"{where} is a DatasetDict with splits {splits}: set `split:` to one of them"
                              + (f" (not {src.split!r})" if src.split else ""))
        folder = path / src.split
    elif src.split:
        raise SourceError(f"{where} is a single Dataset, not a DatasetDict: remove `split: {src.split}`")
    try:
        state = json.loads((folder / "state.json").read_text())
        return path, [folder / f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SourceError(f"{where} is not a dataset saved with `save_to_disk` (its state.json: {e}); "
                          "save it with `Dataset.save_to_disk` or use `format: hf_files`") from None


def fingerprint(files: list[Path]) -> str | None:
    """The `_fingerprint` `datasets` recorded for the split the files belong to (part of the key)."""
    try:
        return json.loads((files[0].parent / "state.json").read_text())["_fingerprint"]
    except (IndexError, OSError, ValueError, KeyError):
        return None


def rows(src: SourceConfig, path: Path) -> Iterator[tuple[int, object]]:
    """(row number from 1, row) of one file: an Arrow file of a saved dataset, memory-mapped, or a local
    file loaded by `src.builder` with `streaming=True`; only the id and text fields are kept. A compressed file
    (.gz, .zst) is first read through once, bounded (`lines.chunks`): `datasets` would hold a line whole, so a
    decompression bomb is stopped before it is handed over."""
    if src.format == Format.hf_files and path.suffix in lines.COMPRESSED:
        for _ in lines.chunks(path, lines.Bound.of(src)):
            pass
    import datasets  # here, not at the top: about a second to import, and only hf_* sources need it

    datasets.disable_progress_bars()
    fields = [f for f in (src.text_field, src.id_field) if f]
    n = 0
    try:
        if src.format == Format.hf_dataset:
            ds = datasets.Dataset.from_file(str(path), in_memory=False)
            keep = [f for f in fields if f in ds.column_names]
            for batch in ds.select_columns(keep).with_format("arrow").iter(batch_size=BATCH):
                for row in batch.to_pylist():
                    n += 1
                    yield n, row
        else:
            stream = datasets.load_dataset(src.builder, data_files=[str(path)], split="train", streaming=True)
            for row in stream:
                n += 1
                yield n, {f: row.get(f) for f in fields}
    except Exception as e:  # whatever `datasets` or its parsers raise mid-file: the rest is unreadable
        raise ReadError(f"{type(e).__name__}: {e}".splitlines()[0][:500]) from e
