"""Ingest: bad records are quarantined with a reason, every record is in the ledger, a bad path fails early."""

import json

import pytest
import zstandard

from moeflow import ingest
from moeflow.configs import SourceConfig
from moeflow.documents import iter_docs
from moeflow.lineage.ledger import read as read_ledger

GOOD = "a perfectly ordinary document " * 3


def _source(tmp_path, name="user", pattern="*.jsonl*", **kw):
    return SourceConfig(name=name, path=str(tmp_path / "in" / pattern), format="jsonl", domain="web", license="cc0", **kw)


def test_bad_records_are_quarantined_with_reasons(tmp_path):
    (tmp_path / "in").mkdir()
    lines = [
        json.dumps({"id": "a", "text": GOOD}).encode(),
        b'{"id": "b", "text": "unterminated',
        json.dumps({"id": "c"}).encode(),
        json.dumps({"id": "d", "text": 42}).encode(),
        json.dumps({"id": "e", "text": "nul\x00byte"}).encode(),
        json.dumps({"id": "f", "text": "   \n\t "}).encode(),
        b'{"id": "g", "text": "caf\xe9"}',
        json.dumps([1, 2]).encode(),
        json.dumps({"id": "a", "text": GOOD + "again"}).encode(),
        json.dumps({"id": "big", "text": "word " * 12_000_000}).encode(),  # 60 MB of text in one document
    ]
    (tmp_path / "in" / "part-0.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    good = zstandard.ZstdCompressor().compress((json.dumps({"id": "z", "text": GOOD}) + "\n").encode())
    (tmp_path / "in" / "part-1.jsonl.zst").write_bytes(good[: len(good) // 2])  # truncated archive
    out = tmp_path / "out"
    out.mkdir()
    stats = ingest.run(ingest.resolve_sources_list([_source(tmp_path, id_field="id")]), out)

    fates = {r["doc_id"]: (r["fate"], r["reason"]) for r in read_ledger(out).to_pylist()}
    assert fates["user/a"] == ("kept", "")
    assert fates["user/part-0.jsonl#L2"] == ("quarantined", "invalid_json")
    assert fates["user/c"] == ("quarantined", "bad_text_field")
    assert fates["user/d"] == ("quarantined", "bad_text_field")
    assert fates["user/e"] == ("quarantined", "nul_bytes")
    assert fates["user/f"] == ("quarantined", "empty_text")
    assert fates["user/part-0.jsonl#L7"] == ("quarantined", "invalid_utf8")
    assert fates["user/part-0.jsonl#L8"] == ("quarantined", "not_an_object")
    assert [v for k, v in fates.items() if k.startswith("user/a@")] == [("quarantined", "duplicate_id")]
    assert fates["user/part-1.jsonl.zst"] == ("quarantined", "unreadable_file")
    assert fates["user/big"] == ("quarantined", "too_large")
    assert stats["documents_in"] == 11 == len(fates)
    assert stats["documents_out"] == 1 == len(list(iter_docs(out)))
    assert stats["fates"]["quarantined"] == 10


def test_source_matching_nothing_fails_naming_it(tmp_path):
    with pytest.raises(ingest.SourceError, match=r"source 'wiki': path .* matches no files"):
        ingest.resolve_source(_source(tmp_path, name="wiki"))


def test_text_files_become_one_document_each(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "one.txt").write_text(GOOD)
    (tmp_path / "in" / "two.txt").write_bytes(b"\xff\xfe broken")
    src = SourceConfig(name="t", path=str(tmp_path / "in" / "*.txt"), domain="x", license="cc0")
    out = tmp_path / "out"
    out.mkdir()
    stats = ingest.run(ingest.resolve_sources_list([src]), out)
    assert [d["id"] for d in iter_docs(out)] == ["t/one.txt"]
    assert stats["fates"] == {"kept": 1, "quarantined": 1, "quarantined:invalid_utf8": 1}


def test_unreadable_files_are_quarantined_naming_the_error(tmp_path):
    import os

    (tmp_path / "in").mkdir()
    for name in ("a", "gone", "locked"):
        (tmp_path / "in" / f"{name}.jsonl").write_text(json.dumps({"id": name, "text": GOOD}) + "\n")
    resolved = ingest.resolve_sources_list([_source(tmp_path, id_field="id")])
    (tmp_path / "in" / "gone.jsonl").unlink()  # vanished between resolution and reading
    locked = tmp_path / "in" / "locked.jsonl"
    locked.chmod(0)  # unreadable, except to root (CI runs as root: then this one is read)
    out = tmp_path / "out"
    out.mkdir()
    stats = ingest.run(resolved, out)
    fates = {r["doc_id"]: (r["fate"], r["reason"], r["detail"]) for r in read_ledger(out).to_pylist()}
    assert fates["user/gone.jsonl"][:2] == ("quarantined", "unreadable_file")
    assert "FileNotFoundError" in fates["user/gone.jsonl"][2] and "gone.jsonl" in fates["user/gone.jsonl"][2]
    if os.geteuid() != 0:
        assert fates["user/locked.jsonl"][:2] == ("quarantined", "unreadable_file")
        assert "PermissionError" in fates["user/locked.jsonl"][2]
    else:
        assert fates["user/locked"][:2] == ("kept", "")
    assert stats["documents_in"] == len(fates) == 3


def test_ingest_streams_memory_does_not_grow_with_the_file(tmp_path):
    """Peak RSS of ingesting a 150 MB JSONL file is within 50 MB of ingesting a 50 MB one (reading files
    whole, it would be 200 MB more): records are read in 1 MB chunks and written in row groups."""
    import subprocess
    import sys

    line = json.dumps({"text": "river stone light north " * 400}) + "\n"  # ~10 KB per record
    peaks = []
    for mb in (50, 150):
        src = tmp_path / f"in{mb}"
        src.mkdir()
        with open(src / "big.jsonl", "w") as f:
            for _ in range(mb * 100):
                f.write(line)
        # VmHWM: the child's own peak (ru_maxrss would carry the forking parent's over exec)
        code = ("import re, sys; from pathlib import Path; from moeflow import ingest; "
                "from moeflow.configs import SourceConfig; out = Path(sys.argv[2]); out.mkdir(); "
                "s = ingest.run(ingest.resolve_sources_list([SourceConfig(name='big', path=sys.argv[1], format='jsonl', "
                "domain='web', license='cc0')]), out); "
                "hwm = re.search(r'VmHWM:\\s+(\\d+)', Path('/proc/self/status').read_text()).group(1); "
                "print(s['documents_out'], int(hwm) // 1024)")
        res = subprocess.run([sys.executable, "-c", code, str(src / "*.jsonl"), str(tmp_path / f"out{mb}")],
                             capture_output=True, text=True, check=True)
        docs, peak = map(int, res.stdout.split())
        assert docs == mb * 100
        peaks.append(peak)
    assert peaks[1] - peaks[0] < 50, peaks
