"""Ingest: bad records are quarantined with a reason, every record is in the ledger.

A bad path fails early.
"""

import json

import pytest
import zstandard

from helpers import run_ingest
from moeflow import ingest
from moeflow.configs import SourceConfig
from moeflow.core.documents import iter_docs
from moeflow.core.ledger import read as read_ledger
from moeflow.ingest import lines as ingest_lines
from moeflow.ingest import plan as ingest_plan
from moeflow.ingest import stage as ingest_stage

GOOD = "a perfectly ordinary document " * 3


def _source(tmp_path, name="user", pattern="*.jsonl*", **kw):
    return SourceConfig(
        name=name, path=str(tmp_path / "in" / pattern), format="jsonl", domain="web", license="cc0", **kw
    )


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
    stats = run_ingest([_source(tmp_path, id_field="id")], out)

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
    stats = run_ingest([src], out)
    assert [d["id"] for d in iter_docs(out)] == ["t/one.txt"]
    assert stats["fates"] == {"kept": 1, "quarantined": 1, "quarantined:invalid_utf8": 1}


def test_unreadable_files_are_quarantined_naming_the_error(tmp_path, monkeypatch):
    import os

    (tmp_path / "in").mkdir()
    for name in ("a", "gone", "locked"):
        (tmp_path / "in" / f"{name}.jsonl").write_text(json.dumps({"id": name, "text": GOOD}) + "\n")
    locked = tmp_path / "in" / "locked.jsonl"

    def resolve_then_lose(sources):  # the shard resolves its sources, then the files change under it
        resolved = ingest.resolve_sources_list(sources)
        (tmp_path / "in" / "gone.jsonl").unlink()  # vanished between resolution and reading
        locked.chmod(0)  # unreadable, except to root (CI runs as root: then this one is read)
        return resolved

    monkeypatch.setattr(ingest_stage, "resolve_sources_list", resolve_then_lose)
    out = tmp_path / "out"
    out.mkdir()
    stats = run_ingest([_source(tmp_path, id_field="id")], out)
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
    from pathlib import Path

    line = json.dumps({"text": "river stone light north " * 400}) + "\n"  # ~10 KB per record
    peaks = []
    for mb in (50, 150):
        src = tmp_path / f"in{mb}"
        src.mkdir()
        with open(src / "big.jsonl", "w") as f:
            for _ in range(mb * 100):
                f.write(line)
        # VmHWM: the child's own peak (ru_maxrss would carry the forking parent's over exec)
        code = (
            "import re, sys; from pathlib import Path; sys.path.insert(0, sys.argv[3]); "
            "from helpers import run_ingest; "
            "from moeflow.configs import SourceConfig; out = Path(sys.argv[2]); out.mkdir(); "
            "s = run_ingest([SourceConfig(name='big', path=sys.argv[1], "
            "format='jsonl', domain='web', license='cc0')], out); "
            "hwm = re.search(r'VmHWM:\\s+(\\d+)', Path('/proc/self/status').read_text()).group(1); "
            "print(s['documents_out'], int(hwm) // 1024)"
        )
        res = subprocess.run(
            [sys.executable, "-c", code, str(src / "*.jsonl"), str(tmp_path / f"out{mb}"),
             str(Path(__file__).parent)],  # the child imports `helpers` from the tests folder
            capture_output=True,
            text=True,
            check=True,
        )
        docs, peak = map(int, res.stdout.split())
        assert docs == mb * 100
        peaks.append(peak)
    assert peaks[1] - peaks[0] < 50, peaks


# Files unreadable part-way: each record of the unreadable tail that can be counted is a ledger row.


def _line(i: int) -> bytes:
    return json.dumps({"text": f"{GOOD}number {i}"}).encode() + b"\n"


LINES = [_line(i) for i in range(1, 6)]  # five records, one per line
HEAD = b"".join(LINES[:2]) + LINES[2][:7]  # lines 1-2 and the first 7 bytes of line 3


def _ledger(tmp_path, files: dict[str, bytes], **kw) -> tuple[list[tuple], dict[str, str]]:
    """Ingest `files` as one source: its ledger rows (id, fate, reason) in order, and the details by id."""
    (tmp_path / "in").mkdir()
    for name, data in files.items():
        (tmp_path / "in" / name).write_bytes(data)
    out = tmp_path / "out"
    out.mkdir()
    stats = run_ingest([_source(tmp_path, **kw)], out)
    table = read_ledger(out).to_pylist()
    fates = sum(n for k, n in stats["fates"].items() if ":" not in k)
    assert stats["documents_in"] == len(table) == fates  # conservation: inputs = sum of fates
    return [(r["doc_id"], r["fate"], r["reason"]) for r in table], {r["doc_id"]: r["detail"] for r in table}


def _cut_tail(name: str) -> list[tuple]:
    """The rows of a file whose lines 1-2 are read, line 3 is cut 7 bytes in, and the rest is undecodable."""
    b = f"user/{name}"
    return [
        (f"{b}#L1", "kept", ""),
        (f"{b}#L2", "kept", ""),
        (f"{b}#L3", "quarantined", "unreadable_file"),
        (f"{b}#rest", "quarantined", "unreadable_file"),
    ]


def _stored_gzip(data: bytes) -> bytes:
    """gzip with a stored (uncompressed) deflate block: byte k of `data` sits at byte 15 + k of the file."""
    import gzip

    assert len(data) < 65_535  # one stored block
    return gzip.compress(data, compresslevel=0, mtime=0)


def test_truncated_gzip_keeps_its_whole_lines_and_quarantines_the_cut_one(tmp_path):
    rows, details = _ledger(tmp_path, {"t.jsonl.gz": _stored_gzip(b"".join(LINES))[: 15 + len(HEAD)]})
    assert rows == _cut_tail("t.jsonl.gz")
    assert "line 3 truncated by the read error after 7 bytes: EOFError" in details["user/t.jsonl.gz#L3"]
    assert "EOFError" in details["user/t.jsonl.gz#rest"] and "unknown" in details["user/t.jsonl.gz#rest"]


def test_gzip_cut_between_lines_has_no_cut_line(tmp_path):
    cut = _stored_gzip(b"".join(LINES))[: 15 + len(LINES[0] + LINES[1])]  # right after line 2's newline
    rows, _ = _ledger(tmp_path, {"t.jsonl.gz": cut})
    assert rows == [
        ("user/t.jsonl.gz#L1", "kept", ""),
        ("user/t.jsonl.gz#L2", "kept", ""),
        ("user/t.jsonl.gz#rest", "quarantined", "unreadable_file"),
    ]


def test_truncated_gzip_past_the_first_megabyte_loses_no_decoded_line(tmp_path):
    """gzip's `read(1 MB)` dropped what it had decoded in the call that hit the cut (here over 100 KB of
    whole lines); every line zlib can decode must come through."""
    import gzip
    import zlib

    data = b"".join(_line(i) for i in range(1, 20_001))  # ~2.3 MB
    cut = gzip.compress(data, mtime=0)
    cut = cut[: len(cut) * 3 // 4]
    decoded = zlib.decompressobj(31).decompress(cut)  # all that can be decoded
    assert data.startswith(decoded) and len(decoded) % ingest_lines.CHUNK > 100_000
    whole = decoded.count(b"\n")
    rows, details = _ledger(tmp_path, {"big.jsonl.gz": cut})
    b = "user/big.jsonl.gz"
    assert rows == [(f"{b}#L{n}", "kept", "") for n in range(1, whole + 1)] + [
        (f"{b}#L{whole + 1}", "quarantined", "unreadable_file"),
        (f"{b}#rest", "quarantined", "unreadable_file"),
    ]
    partial = len(decoded) - decoded.rindex(b"\n") - 1
    assert f"truncated by the read error after {partial} bytes" in details[f"{b}#L{whole + 1}"]


def test_truncated_zstd_keeps_the_blocks_before_the_cut(tmp_path):
    """One frame of two blocks (the first flushed 7 bytes into line 3), cut 3 bytes into the second block."""
    c = zstandard.ZstdCompressor().compressobj()
    first = c.compress(HEAD) + c.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
    whole = first + c.compress(b"".join(LINES)[len(HEAD) :]) + c.flush()
    rows, details = _ledger(tmp_path, {"t.jsonl.zst": whole[: len(first) + 3]})
    assert rows == _cut_tail("t.jsonl.zst")
    assert "line 3 truncated by the read error after 7 bytes: EOFError" in details["user/t.jsonl.zst#L3"]


def test_zstd_whose_second_frame_is_corrupt(tmp_path):
    """Frame 1 holds lines 1-2 and the start of line 3; frame 2 (the rest) fails to decode: its lines are
    not counted one by one, since nothing says how many there are."""
    zc = zstandard.ZstdCompressor(write_checksum=True)
    second = bytearray(zc.compress(b"".join(LINES)[len(HEAD) :]))
    second[-5] ^= 0xFF  # a byte of block data (the last 4 bytes are the checksum)
    rows, details = _ledger(tmp_path, {"t.jsonl.zst": zc.compress(HEAD) + bytes(second)})
    assert rows == _cut_tail("t.jsonl.zst")
    assert "truncated by the read error after 7 bytes: ZstdError" in details["user/t.jsonl.zst#L3"]
    assert "ZstdError" in details["user/t.jsonl.zst#rest"] and "unknown" in details["user/t.jsonl.zst#rest"]


def test_gzip_whose_second_member_is_corrupt_is_accounted_not_a_crash(tmp_path):
    """Corrupt deflate data raises zlib.error, which once escaped ingest and failed the run."""
    import gzip

    bad_member = gzip.compress(b"x", mtime=0)[:10] + b"\xff" * 8  # block type 3: invalid
    rows, details = _ledger(tmp_path, {"t.jsonl.gz": gzip.compress(HEAD, mtime=0) + bad_member})
    assert rows == _cut_tail("t.jsonl.gz")
    rest = details["user/t.jsonl.gz#rest"]
    assert rest.startswith("zlib.error: Error -3 while decompressing data: invalid block type")
    assert "unknown" in rest


def test_plain_file_read_error_mid_file(tmp_path, monkeypatch):
    """An OS read error (EIO) on a plain file: the bytes read before it are used, the rest is unknown."""
    import errno

    def failing_chunks(path, *bound):
        yield HEAD
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(ingest_lines, "chunks", failing_chunks)
    rows, details = _ledger(tmp_path, {"t.jsonl": b"".join(LINES)})
    assert rows == _cut_tail("t.jsonl")
    assert "after 7 bytes: OSError: [Errno 5] Input/output error" in details["user/t.jsonl#L3"]


def test_parquet_rows_left_unread_are_counted_from_the_footer(tmp_path):
    """Parquet's footer knows how many rows each row group holds, so every row a failing group leaves
    unread gets a row of its own and the next group is still read; a file whose footer is unreadable is one
    row (ArrowInvalid once escaped ingest and failed the run)."""
    (tmp_path / "in").mkdir()
    _corrupt_parquet(tmp_path / "in" / "a.parquet", rows=9)
    (tmp_path / "in" / "b.parquet").write_bytes(b"PAR1 not really")
    out = tmp_path / "out"
    out.mkdir()
    stats = run_ingest([_parquet_source(tmp_path)], out)
    rows = [(r["doc_id"], r["fate"], r["reason"]) for r in read_ledger(out).to_pylist()]
    assert rows[:-1] == [(f"p/a.parquet#L{n}", "kept", "") for n in (1, 2, 3)] + [
        (f"p/a.parquet#L{n}", "quarantined", "unreadable_file") for n in (4, 5, 6)
    ] + [(f"p/a.parquet#L{n}", "kept", "") for n in (7, 8, 9)]
    assert rows[-1] == ("p/b.parquet", "quarantined", "unreadable_file")
    assert stats["documents_in"] == len(rows) == stats["fates"]["kept"] + stats["fates"]["quarantined"]


def _parquet_source(tmp_path, pattern="*.parquet", **kw):
    return SourceConfig(name="p", path=str(tmp_path / "in" / pattern), format="parquet", domain="x",
                        license="cc0", **kw)


def _corrupt_parquet(path, rows: int, group: int = 3, bad: int = 1, field: str = "text"):
    """A parquet file of `rows` documents in row groups of `group`, the page header of group `bad` broken."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"{GOOD}{path.stem} {i}" for i in range(rows)]
    table = pa.table({field: texts, "id": [f"r{i % 5}" for i in range(rows)]})
    pq.write_table(table, path, row_group_size=group, compression="none")
    data = bytearray(path.read_bytes())
    page = pq.ParquetFile(path).metadata.row_group(bad).column(0).data_page_offset
    data[page : page + 8] = b"\xff" * 8
    path.write_bytes(bytes(data))


def _mixed_corpus(tmp_path) -> list[SourceConfig]:
    """Sources of every format with the cases that make sharding hard: ids repeated across files (so across
    shards), a capped source, a parquet file of many row groups with a broken one, cut and empty files."""
    d = tmp_path / "in"
    d.mkdir()
    for i in range(6):
        lines = [json.dumps({"id": f"k{(i * 7 + j) % 11}", "text": f"{GOOD} {i} {j}"}) for j in range(9)]
        data = ("\n".join(lines) + "\n").encode()
        if i % 3 == 1:
            data = zstandard.ZstdCompressor().compress(data)
        (d / f"keyed-{i}.jsonl{'.zst' if i % 3 == 1 else ''}").write_bytes(data[:-9] if i == 4 else data)
    (d / "keyed-9.jsonl").write_bytes(b"")
    long = json.dumps({"id": "long", "text": GOOD * 9})  # longer than a span: several spans start inside it
    (d / "keyed-8.jsonl").write_bytes(  # blank lines, CRLF, a bad line, no newline at the end
        f'\n{long}\r\n\n{{"id": "k3", "text": "x y"}}\n{{oops\n\n\n{long}\n'.encode()
        + b'{"id": "last", "text": "end"}'
    )
    for i in range(3):
        (d / f"plain-{i}.txt").write_text(f"{GOOD} plain {i}" if i != 1 else "  ")
    _corrupt_parquet(d / "rows.parquet", rows=40, group=4, bad=3)
    _corrupt_parquet(d / "capped.parquet", rows=10, group=2, bad=4)
    return [
        _source(tmp_path, name="keyed", pattern="keyed-*", id_field="id"),
        SourceConfig(name="t", path=str(d / "plain-*.txt"), domain="x", license="cc0"),
        _parquet_source(tmp_path, "rows.parquet", id_field="id"),
        SourceConfig(name="c", path=str(d / "capped.parquet"), format="parquet", domain="x", license="cc0",
                     max_docs=7),
    ]


@pytest.mark.parametrize("shards", [1, 2, 3, 8, 40])
def test_sharded_ingest_is_byte_identical_to_one_process(tmp_path, shards, monkeypatch):
    """Files, parquet row groups and byte spans of plain jsonl files (37 bytes here, so spans start inside
    lines) spread over shards, joined in order: the same documents, ledger and stats (repeated ids resolved
    across shards, row groups read past a broken one) as one process reading every file whole."""
    sources = _mixed_corpus(tmp_path)
    outs = {}
    for n in (1, shards):
        if n == shards:
            monkeypatch.setattr(ingest_plan, "SPAN_BYTES", 37)
            assert sum(u.span is not None for u in ingest.units(ingest.resolve_sources_list(sources))) > 40
        outs[n] = tmp_path / f"out{n}"
        outs[n].mkdir(exist_ok=True)
        stats = run_ingest(sources, outs[n], shards=n)
        assert stats.pop("shards") == n
        outs[n] = (stats, *((outs[n] / f).read_bytes() for f in ("docs.parquet", "ledger.parquet")))
    assert outs[shards] == outs[1]
    ledger = read_ledger(tmp_path / "out1").to_pylist()
    fates = [(r["doc_id"], r["fate"], r["reason"]) for r in ledger]
    assert len({f[0] for f in fates}) == len(fates) == outs[1][0]["documents_in"]
    # the id rule: an id's first record keeps it; a later one is `<id>@<its place>` (quarantined if good)
    first = {}
    for place, (doc_id, fate, _) in enumerate(fates, start=1):
        base, _, suffix = doc_id.partition("@")
        if suffix:
            assert int(suffix) == place and first[base] < place and fate == "quarantined", doc_id
        else:
            first[base] = place
    renamed = [r for r in fates if "@" in r[0]]
    assert sum(reason == "duplicate_id" for _, _, reason in renamed) >= 40
    assert ("keyed/k7@10", "quarantined", "duplicate_id") in renamed  # keyed-1.jsonl.zst's first line
    assert ("p/rows.parquet#L13", "quarantined", "unreadable_file") in fates  # the broken group, then
    assert ("p/r1@71", "quarantined", "duplicate_id") in fates  # the group after it: row 17, place 54 + 17
    assert [f for f in fates if f[0].startswith(("keyed/long", "keyed/last", "keyed/keyed-8"))] == [
        ("keyed/long", "kept", ""), ("keyed/keyed-8.jsonl#L5", "quarantined", "invalid_json"),
        ("keyed/long@50", "quarantined", "duplicate_id"), ("keyed/last", "kept", "")]
    assert sum(doc_id.startswith("c/") for doc_id, _, _ in fates) == 7  # the cap, across row groups


def test_a_join_copying_arrow_row_groups_writes_the_bytes_row_writes_do(tmp_path):
    """`join` copies its parts' row groups in Arrow (no row turned into a dict and back): cut and concatenated
    there, the file must still be byte for byte the one `write` makes from the same rows (groups of ~1.5 MB:
    a slice spanning two parts' chunks is written differently unless its chunks are combined first)."""
    import random

    import pyarrow as pa

    from moeflow.core.documents import SCHEMA, DocWriter

    docs = [{"id": f"corpus/{i}", "source": "s", "domain": "web", "path": f"cache:f{i % 3}", "text": f"w{i} " * 2000}
            for i in range(300)]
    (tmp_path / "rows").mkdir()
    with DocWriter(tmp_path / "rows", rows_per_group=128) as w:
        for d in docs:
            w.write(d)
    cuts = sorted(random.Random(0).sample(range(1, 300), 7))
    (tmp_path / "tables").mkdir()
    with DocWriter(tmp_path / "tables", rows_per_group=128) as w:
        for lo, hi in zip([0, *cuts], [*cuts, 300], strict=True):  # uneven pieces, as parts' groups are
            w.write_table(pa.Table.from_pylist(docs[lo:hi], schema=SCHEMA))
    assert w.count == 300
    assert (tmp_path / "rows" / "docs.parquet").read_bytes() == (tmp_path / "tables" / "docs.parquet").read_bytes()


def test_lines_orjson_would_read_otherwise_are_read_as_json_reads_them(tmp_path):
    """orjson parses the common line, `json` the lines where the two part (`ingest.jsonl._fast`): an integer
    past 64 bits in the id or text field (orjson: a float), and nesting past `jsonl.MAX_DEPTH` within orjson's
    1,024 levels (orjson reads it; ingest quarantines it)."""
    (tmp_path / "in").mkdir()
    big = 18446744073709551616
    deep = '{"id": "deep", "text": "x", "a": ' + "[" * 1010 + "]" * 1010 + "}"
    lines = [json.dumps({"id": big, "text": GOOD}), json.dumps({"id": [big, {"n": -big}], "text": GOOD}),
             json.dumps({"id": "t", "text": big}), deep, json.dumps({"id": 7, "text": GOOD, "score": 0.5})]
    (tmp_path / "in" / "a.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    run_ingest([_source(tmp_path, id_field="id")], out)
    rows = [(r["doc_id"], r["fate"], r["reason"], r["detail"]) for r in read_ledger(out).to_pylist()]
    assert rows == [
        (f"user/{big}", "kept", "", ""),
        (f"user/[{big}, {{'n': -{big}}}]", "kept", "", ""),
        ("user/t", "quarantined", "bad_text_field", "field 'text' is a int, not a string"),
        ("user/a.jsonl#L4", "quarantined", "invalid_json", "line 4: nested deeper than 512 levels"),
        ("user/7", "kept", "", ""),
    ]


@pytest.mark.parametrize("limit", [None, 100_000])
def test_deep_lines_are_invalid_json_whatever_the_recursion_limit(tmp_path, limit):
    """Nesting is checked by counting, so a worker whose recursion limit a library raised still quarantines a
    1,000-deep line (it was once read as a list, `not_an_object`); brackets inside strings do not count, and
    a line nested 512 deep is read."""
    import sys

    (tmp_path / "in").mkdir()
    lines = ["[" * 1000 + "]" * 1000, '{"text": "x", "a": ' + "{\"b\": " * 2000 + "1" + "}" * 2000 + "}",
             json.dumps({"text": "[" * 2000, "a": [[]] * 600}), '{"text": "y", "a": ' + "[" * 511 + "]" * 511 + "}"]
    (tmp_path / "in" / "a.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(limit or before)
    try:
        run_ingest([_source(tmp_path)], out)
    finally:
        sys.setrecursionlimit(before)
    rows = [(r["doc_id"], r["fate"], r["reason"]) for r in read_ledger(out).to_pylist()]
    assert rows == [("user/a.jsonl#L1", "quarantined", "invalid_json"),
                    ("user/a.jsonl#L2", "quarantined", "invalid_json"),
                    ("user/a.jsonl#L3", "kept", ""), ("user/a.jsonl#L4", "kept", "")]


def test_documents_files_keep_no_dictionary_or_statistics_of_the_text(tmp_path):
    """A documents file's text column has neither (min/max over long strings took most of a writer's time,
    and a dictionary of texts is given up after its first page); the short label columns keep both."""
    import pyarrow.parquet as pq

    from moeflow.core.documents import DOCS, DocWriter

    with DocWriter(tmp_path) as w:
        for i in range(3):
            w.write({"id": f"d{i}", "source": "s", "domain": "web", "path": "p", "text": GOOD * (i + 1)})
    meta = pq.ParquetFile(tmp_path / DOCS).metadata.row_group(0)
    columns = {meta.column(i).path_in_schema: meta.column(i) for i in range(meta.num_columns)}
    assert not columns["text"].is_stats_set and not columns["text"].has_dictionary_page
    assert columns["id"].is_stats_set and columns["id"].has_dictionary_page


def test_parts_of_a_sharded_stage_record_no_previous_artifact(tmp_path):
    """Only a stage's artifact names the previous one (the report diffs configs against it): a part would
    name a sibling shard, and every part reading each earlier part's record was n²/2 reads for n parts."""
    from helpers import stage_config
    from moeflow.tasks.runner import materialize

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("".join(json.dumps({"text": f"{GOOD} {i}"}) + "\n" for i in range(9)))
    cfg = stage_config(tmp_path / "store", 3, sources=(_source(tmp_path),))
    first = materialize("ingest", cfg, {})
    again = materialize("ingest", cfg, {}, force=True)
    parts = sorted((tmp_path / "store" / "ingest.shard").glob("ingest.shard-*/lineage.json"))
    assert len(parts) == 3 and all(json.loads(p.read_text())["previous"] is None for p in parts)
    assert again.lineage()["previous"]["artifact"] == f"ingest-{first.hash}"


def test_a_worker_running_ingest_imports_no_pandas(tmp_path):
    """A fresh process running ingest's parts and join never imports pandas (0.4 s and ~50 MB a worker):
    pyarrow imports it to ask whether a Python list is a pandas object (`pa.array`, `pa.table`) and when
    `pq.read_table` loads `pyarrow.dataset`; `core.columns` and `ParquetFile` go around both."""
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "in").mkdir()
    lines = [json.dumps({"text": f"{GOOD} {i}", "id": f"d{i % 7}"}) for i in range(20)] + ["{oops", '"a"']
    (tmp_path / "in" / "a.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "out").mkdir()
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from pathlib import Path
from helpers import run_ingest
from moeflow.configs import SourceConfig
assert "pandas" not in sys.modules, "imported before ingest ran"
src = SourceConfig(name="u", path={str(tmp_path / "in" / "*.jsonl")!r}, format="jsonl", domain="web",
                   license="cc0", id_field="id")
stats = run_ingest([src], Path({str(tmp_path / "out")!r}), shards=3)
print(stats["documents_in"], stats["documents_out"], "pandas" in sys.modules)
"""
    got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert got.stdout.split() == ["22", "7", "False"], got.stdout + got.stderr[-3000:]


def test_string_columns_are_what_pa_array_makes():
    """`core.columns.strings` (built from buffers, without pandas) makes the array `pa.array` makes: nulls,
    empty strings, non-ASCII text, either offset width; a lone surrogate fails as it fails `pa.array`."""
    import pyarrow as pa

    from moeflow.core.columns import strings

    values = ["a", None, "", "é ✓ \U0001f600", "x" * 70_000, None, "\x01 tab\t"]
    for kind in (pa.string(), pa.large_string()):
        for sample in (values, [], [None], ["only"]):
            made = strings(sample, kind)
            made.validate(full=True)
            assert made.equals(pa.array(sample, kind)) and made.type == kind and made.null_count == sample.count(None)
        with pytest.raises(UnicodeEncodeError):
            strings(["ok", "\ud800"], kind)
    with pytest.raises(TypeError, match="got a int"):
        strings(["ok", 3], pa.string())


@pytest.mark.parametrize("shards", [1, 3])
def test_shards_write_their_documents_uncompressed_and_the_join_compresses_them(tmp_path, shards):
    """Only the join reads a shard's documents file, once: the shard writes it uncompressed and the join
    writes the zstd file (one shard's file is rewritten, not copied), the same bytes for any shard count."""
    import pyarrow.parquet as pq

    from helpers import stage_config
    from moeflow.tasks.runner import materialize

    def compression(folder):
        meta = pq.ParquetFile(folder / "docs.parquet").metadata
        return {meta.row_group(g).column(c).compression for g in range(meta.num_row_groups)
                for c in range(meta.num_columns)}

    (tmp_path / "in").mkdir()
    for f in "abc":  # a file a shard
        (tmp_path / "in" / f"{f}.jsonl").write_text("".join(json.dumps({"text": f"{GOOD} {f}{i}"}) + "\n"
                                                            for i in range(3)))
    joined = {}
    for n in sorted({1, shards}):
        made = materialize("ingest", stage_config(tmp_path / f"store{n}", n, sources=(_source(tmp_path),)), {})
        parts = sorted((tmp_path / f"store{n}" / "ingest.shard").glob("ingest.shard-*"))
        assert len(parts) == n and all(compression(p) == {"UNCOMPRESSED"} for p in parts)
        assert compression(made.dir) == {"ZSTD"}
        joined[n] = (made.dir / "docs.parquet").read_bytes()
    assert joined[shards] == joined[1]


def test_a_documents_file_is_the_same_whether_its_texts_come_as_str_or_utf8_bytes(tmp_path):
    """Ingest encodes each text once, for its size and for its column, and hands `DocWriter` the bytes: the
    file is byte for byte the one the str makes, and reads back as the str."""
    from moeflow.core.documents import DOCS, DocWriter

    texts = ["é ✓ \U0001f600 " * 50, GOOD, "x"]
    docs = [{"id": f"d{i}", "source": "s", "domain": "web", "path": "p", "text": t} for i, t in enumerate(texts)]
    for form in ("str", "bytes"):
        (tmp_path / form).mkdir()
        with DocWriter(tmp_path / form, rows_per_group=2) as w:
            for d in docs:
                w.write({**d, "text": d["text"].encode()} if form == "bytes" else d)
    assert (tmp_path / "bytes" / DOCS).read_bytes() == (tmp_path / "str" / DOCS).read_bytes()
    assert [d["text"] for d in iter_docs(tmp_path / "bytes")] == texts
