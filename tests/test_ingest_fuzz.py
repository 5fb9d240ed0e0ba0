"""Ingest fuzzed: generated folders of good and hostile records, across formats, encodings, compression and
the file system; every case must finish, keep each good record's exact text, quarantine each bad one with
its reason, conserve the ledger and give the same bytes twice (and sharded).

`make test` runs a bounded, derandomised budget; `make fuzz` a longer one (`MOEFLOW_FUZZ_EXAMPLES`).
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from helpers import run_ingest
from moeflow.configs import SourceConfig
from moeflow.core.documents import iter_docs
from moeflow.core.ledger import read as read_ledger
from moeflow.ingest import lines as ingest_lines

EXAMPLES = int(os.environ.get("MOEFLOW_FUZZ_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("MOEFLOW_FUZZ_RANDOM"),
                suppress_health_check=list(HealthCheck), database=None)
MAX_DOC = 4000  # the fuzzed sources' max_doc_bytes

# text a good record may hold: any character but NUL and lone surrogates, not all whitespace
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1,
               max_size=300).filter(lambda t: t.strip())


@dataclass
class Line:
    """One generated JSONL line: its bytes and what ingest must make of it (None: blank, no record)."""

    data: bytes
    reason: str | None = None  # the quarantine reason; None with `text`: a good record
    text: str | None = None


def _good(text: str, ascii_only: bool, dup_key: bool) -> Line:
    body = json.dumps({"text": text}, ensure_ascii=ascii_only)
    if dup_key:  # the last of repeated keys wins, as in json.loads
        body = '{"text": "first", ' + body[1:]
    return Line(body.encode(), text=text)


BAD = {  # kind -> (line bytes, reason)
    "cut_json": (b'{"text": "unterminated', "invalid_json"),
    "deep": (b"[" * 5000 + b"]" * 5000, "invalid_json"),
    "deep_object": (b'{"a": ' * 3000 + b"1" + b"}" * 3000, "invalid_json"),
    "huge_int": (b'{"text": "x", "n": 1' + b"9" * 5000 + b"}", "invalid_json"),
    "raw_nul": (b'{"text": "a\x00b"}', "invalid_json"),
    "array_root": (b"[1, 2]", "not_an_object"),
    "string_root": (b'"text"', "not_an_object"),
    "null_root": (b"null", "not_an_object"),
    "number_text": (b'{"text": 42}', "bad_text_field"),
    "no_text": (b'{"id": "x"}', "bad_text_field"),
    "list_text": (b'{"text": ["a"]}', "bad_text_field"),
    "escaped_surrogate": (b'{"text": "a\\ud800b"}', "invalid_unicode"),
    "escaped_low_surrogate": (b'{"text": "\\udfff"}', "invalid_unicode"),
    "raw_surrogate": (b'{"text": "a\xed\xa0\x80b"}', "invalid_utf8"),
    "overlong_utf8": (b'{"text": "\xc0\xaf"}', "invalid_utf8"),
    "invalid_utf8": (b'{"text": "caf\xe9"}', "invalid_utf8"),
    "escaped_nul": (b'{"text": "a\\u0000b"}', "nul_bytes"),
    "blank_text": (b'{"text": " \\t\\n "}', "empty_text"),
    "too_large": (json.dumps({"text": "w" * (MAX_DOC + 1)}).encode(), "too_large"),
    "too_large_escaped": (json.dumps({"text": "\u00e9" * (MAX_DOC // 2 + 1)}).encode(), "too_large"),
}

LINES = st.one_of(
    st.builds(_good, TEXT, st.booleans(), st.booleans()),
    st.sampled_from(sorted(BAD)).map(lambda k: Line(BAD[k][0], reason=BAD[k][1])),
    st.sampled_from([b"", b"   ", b"\t"]).map(lambda b: Line(b)),
)


@dataclass
class JsonlFile:
    lines: list[Line]
    ends: list[bytes]  # each line's end: \n or \r\n
    final_newline: bool
    bom: bool
    container: str  # "", ".gz", ".zst"
    split: bool  # compressed in two frames / members, concatenated
    name: str = ""

    def data(self) -> bytes:
        parts = [line.data + end for line, end in zip(self.lines, self.ends, strict=True)]
        raw = b"".join(parts)
        if self.lines and not self.final_newline:
            raw = raw[: -len(self.ends[-1])]
        if self.bom:
            raw = b"\xef\xbb\xbf" + raw
        if not self.container:
            return raw
        cut = len(raw) // 2 if self.split else len(raw)
        pack = gzip.compress if self.container == ".gz" else zstandard.ZstdCompressor().compress
        return pack(raw[:cut]) + (pack(raw[cut:]) if self.split else b"")

    def expected(self) -> dict[int, Line]:
        """Line number -> the line, for the lines that are records."""
        return {n: line for n, line in enumerate(self.lines, start=1) if line.data.strip()}


@st.composite
def jsonl_files(draw) -> JsonlFile:
    lines = draw(st.lists(LINES, max_size=12))
    ends = draw(st.lists(st.sampled_from([b"\n", b"\r\n"]), min_size=len(lines), max_size=len(lines)))
    bom = draw(st.booleans()) and bool(lines) and lines[0].data.strip() != b""
    return JsonlFile(lines, ends, draw(st.booleans()), bom, draw(st.sampled_from(["", ".gz", ".zst"])),
                     draw(st.booleans()))


LINKS = ["file", "hard", "folder", "loop", "dangling", "fifo"]
NAMES = st.sampled_from(["a", "b c", "new\nline", "caf\u00e9", "x" * 40, "dot.dot", "-dash"])


@dataclass
class Corpus:
    files: list[JsonlFile]
    links: list[str] = field(default_factory=list)  # "file", "hard", "folder", "loop", "dangling", "fifo"


@st.composite
def corpora(draw) -> Corpus:
    files = draw(st.lists(jsonl_files(), min_size=1, max_size=5))
    names = draw(st.lists(NAMES, min_size=len(files), max_size=len(files), unique=True))
    for f, name in zip(files, names, strict=True):
        f.name = f"{name}.jsonl{f.container}"
    links = draw(st.lists(st.sampled_from(LINKS), unique=True))
    return Corpus(files, links)


def _lay_out(corpus: Corpus, folder: Path) -> None:
    """The files under `folder/in/`, and the links and special files asked for beside them."""
    d = folder / "in"
    (d / "sub").mkdir(parents=True)
    for f in corpus.files:
        (d / "sub" / f.name).write_bytes(f.data())
    first = d / "sub" / corpus.files[0].name
    for kind in corpus.links:
        if kind == "file":
            (d / "sub" / "zz-link.jsonl").symlink_to(first)
        elif kind == "hard":
            os.link(first, d / "sub" / "zz-hard.jsonl")
        elif kind == "folder":
            (d / "zz-folder").symlink_to(d / "sub", target_is_directory=True)
        elif kind == "loop":
            (d / "sub" / "zz-loop").symlink_to(d / "sub", target_is_directory=True)
        elif kind == "dangling":
            (d / "sub" / "zz-gone.jsonl").symlink_to(d / "nowhere.jsonl")
        elif kind == "fifo":
            os.mkfifo(d / "sub" / "zz-fifo.jsonl")


def _run(folder: Path, out: Path, shards: int = 1) -> tuple[dict, bytes, bytes]:
    src = SourceConfig(name="f", path=str(folder / "in" / "**" / "*.jsonl*"), format="jsonl", domain="x",
                       license="cc0", max_doc_bytes=MAX_DOC)
    out.mkdir()
    stats = run_ingest([src], out, shards=shards)
    return stats, (out / "docs.parquet").read_bytes(), (out / "ledger.parquet").read_bytes()


def _check_jsonl(corpus: Corpus, folder: Path) -> None:
    stats, docs, ledger = _run(folder, folder / "out")
    rows = {r["doc_id"]: r for r in read_ledger(folder / "out").to_pylist()}
    texts = {d["id"]: d["text"] for d in iter_docs(folder / "out")}
    want = 0
    for f in corpus.files:
        for n, line in f.expected().items():
            doc_id = f"f/sub/{f.name}#L{n}"
            row = rows[doc_id]
            if line.reason is None:
                assert (row["fate"], texts[doc_id]) == ("kept", line.text), doc_id
            else:
                assert (row["fate"], row["reason"]) == ("quarantined", line.reason), (doc_id, row)
            want += 1
    # every record once: no alias, link or loop read a file twice; a FIFO never read (it would block)
    assert stats["documents_in"] == len(rows) == want
    assert stats["documents_out"] == len(texts) == sum(r["fate"] == "kept" for r in rows.values())
    skipped = stats["sources"]["f"]["skipped_paths"]
    assert skipped >= len(set(corpus.links) & {"file", "hard", "dangling", "fifo"})
    again = _run(folder, folder / "again", shards=3)
    assert (again[0] | {"shards": 1}, *again[1:]) == (stats, docs, ledger)  # the same bytes, sharded too


@FUZZ
@given(corpora())
def test_fuzzed_jsonl_sources(tmp_path_factory, corpus):
    folder = tmp_path_factory.mktemp("fuzz")
    _lay_out(corpus, folder)
    _classes(corpus)
    _check_jsonl(corpus, folder)


def _classes(corpus: Corpus) -> None:
    """The case's classes, counted by `make fuzz` (hypothesis statistics: % of cases holding each)."""
    for name in {line.reason or "good" for f in corpus.files for line in f.lines if line.data.strip()}:
        event(f"record {name}")
    for f in corpus.files:
        event(f"file {f.container or 'plain'}{' split' * f.split}{' bom' * f.bom}")
        event(f"line ends {'mixed' if len(set(f.ends)) > 1 else 'one kind'}")
    for kind in corpus.links:
        event(f"path {kind}")


def _cut(data: bytes, at: float) -> bytes:
    return data[: int(len(data) * at)]


def _bad(kind: str) -> Line:
    return Line(BAD[kind][0], reason=BAD[kind][1])


@FUZZ
@given(jsonl_files().filter(lambda f: f.container), st.floats(0.05, 0.95),
       st.sampled_from(["cut", "magic", "plain"]))
# issue 40: zstd named as plain; its literals hold a line `{"text": "x", "n": 19}` (the 9s of `huge_int` are a
# match) and, unsplit, `{"text": "w"}` (`too_large`): lines of the file as it is, kept with their own text
@example(JsonlFile([_bad("huge_int"), _good("0", False, False), _bad("huge_int"), _bad("array_root")],
                   [b"\n"] * 4, False, False, ".zst", True), 0.5, "plain")
@example(JsonlFile([_bad("array_root")] * 6 + [_bad("too_large"), Line(b"")] + [_good("0", False, False)] * 4,
                   [b"\n"] * 12, False, False, ".zst", False), 0.5, "plain")
def test_fuzzed_broken_compressed_files(tmp_path_factory, f, at, how):
    """A compressed file cut short, with a wrong magic number, or named as plain: the stage finishes, what
    it keeps are good records with their exact text, everything else is quarantined, conservation holds."""
    folder = tmp_path_factory.mktemp("fuzz")
    (folder / "in").mkdir()
    data = f.data()
    name = f"f{f.container}" if how != "plain" else "f.jsonl"
    broken = {"cut": _cut(data, at), "magic": b"\x00\x01" + data[2:], "plain": data}[how]
    (folder / "in" / name).write_bytes(broken)
    src = SourceConfig(name="f", path=str(folder / "in" / "*"), format="jsonl", domain="x", license="cc0",
                       max_doc_bytes=MAX_DOC)
    out = folder / "out"
    out.mkdir()
    stats = run_ingest([src], out)
    expected = f.expected()
    texts = {d["id"]: d["text"] for d in iter_docs(out)}
    for row in read_ledger(out).to_pylist():
        base, _, line = row["doc_id"].partition("#L")
        assert base == f"f/{name}" or row["doc_id"] in (f"f/{name}", f"f/{name}#rest"), row
        if row["fate"] == "kept" and how == "plain":  # compressed bytes read as lines: what parses is kept
            assert texts[row["doc_id"]] == _text_at(broken, int(line))
        elif row["fate"] == "kept":
            assert texts[row["doc_id"]] == expected[int(line)].text
        else:
            assert row["fate"] == "quarantined" and row["reason"], row
    assert stats["documents_in"] == stats["fates"].get("kept", 0) + stats["fates"].get("quarantined", 0)


def _text_at(data: bytes, n: int) -> str:
    """The text field of line `n` of `data` as it is: in compressed bytes read as plain, a line can parse
    although it is no line of the file compressed (a zstd block stores the original lines' literals between
    its matches, so `{"text": "x", "n": 1999...}` can read as `{"text": "x", "n": 19}`)."""
    line = data.split(b"\n")[n - 1].decode("utf-8")
    return json.loads(line.removeprefix("\ufeff") if n == 1 else line)["text"]


PARQUET_ROWS = st.lists(st.one_of(TEXT, st.none(), st.just(""), st.just("\x00")), min_size=1, max_size=30)


@FUZZ
@given(PARQUET_ROWS, st.integers(1, 7), st.sampled_from(["none", "footer", "page"]), st.integers(1, 4))
def test_fuzzed_parquet_sources(tmp_path_factory, texts, group, damage, shards):
    """Parquet files of good and bad rows in row groups, whole, with a cut footer or a broken page: the
    rows of readable groups are kept or quarantined as one process reads them, every row accounted for."""
    folder = tmp_path_factory.mktemp("fuzz")
    (folder / "in").mkdir()
    path = folder / "in" / "p.parquet"
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), path, row_group_size=group,
                   compression="none")
    meta = pq.ParquetFile(path).metadata
    data = bytearray(path.read_bytes())
    if damage == "footer":
        data = data[:-10]
    elif damage == "page":
        page = meta.row_group(meta.num_row_groups // 2).column(0).data_page_offset
        data[page : page + 8] = b"\xff" * 8
    path.write_bytes(bytes(data))
    src = SourceConfig(name="p", path=str(path), format="parquet", domain="x", license="cc0",
                       max_doc_bytes=MAX_DOC)
    outs = []
    for n in sorted({1, shards}):
        out = folder / f"out{n}"
        out.mkdir()
        stats = run_ingest([src], out, shards=n)
        outs.append(((out / "docs.parquet").read_bytes(), (out / "ledger.parquet").read_bytes()))
    assert outs[0] == outs[-1]
    rows = read_ledger(folder / "out1").to_pylist()
    if damage == "footer":
        assert [(r["doc_id"], r["reason"]) for r in rows] == [("p/p.parquet", "unreadable_file")]
        return
    assert [r["doc_id"] for r in rows] == [f"p/p.parquet#L{n}" for n in range(1, len(texts) + 1)]
    texts_out = {d["id"]: d["text"] for d in iter_docs(folder / "out1")}
    for n, (text, row) in enumerate(zip(texts, rows, strict=True), start=1):
        if row["fate"] == "kept":
            assert texts_out[row["doc_id"]] == text
        elif row["reason"] != "unreadable_file":  # a good row in a broken group is unreadable, not kept
            assert text is None or not text.strip() or "\x00" in text, (n, text, row)
    assert stats["documents_in"] == len(texts)


# (file bytes, what ingest must make of it: ("kept", the text) or ("quarantined", the reason)); the two
# kept apart: hypothesis also draws the string constants of the code under test, so a file's text can be
# "too_large" or "invalid_utf8" (issue 40: such a text file, rightly kept, read as a reason it lacked)
TEXT_FILES = st.one_of(
    st.tuples(TEXT, st.booleans()).map(lambda t: _text_file("\ufeff" * t[1] + t[0])),
    st.tuples(TEXT, st.integers(0, 50)).map(  # invalid UTF-8 at a generated place
        lambda t: (t[0].encode()[: t[1]] + b"\xff" + t[0].encode()[t[1] :], ("quarantined", "invalid_utf8"))),
    st.sampled_from([(b"", "empty_text"), (b" \n\t", "empty_text"), (b"a\x00b", "nul_bytes"),
                     (b"\xed\xa0\x80", "invalid_utf8"), (b"w" * (MAX_DOC + 1), "too_large")]).map(
        lambda t: (t[0], ("quarantined", t[1]))),
)


def _text_file(text: str) -> tuple[bytes, tuple[str, str]]:
    """A text file's bytes and what is kept of it: all but a leading BOM (or `empty_text` if that is all)."""
    kept = text.removeprefix("\ufeff")
    return text.encode(), ("kept", kept) if kept.strip() else ("quarantined", "empty_text")


@FUZZ
@given(st.lists(st.tuples(TEXT_FILES, st.sampled_from(["", ".gz", ".zst"])), min_size=1, max_size=8),
       st.integers(1, 4))
@example([(_text_file("too_large"), "")], 1)  # issue 40's falsifying examples
@example([(_text_file("invalid_utf8"), "")], 1)
def test_fuzzed_text_sources(tmp_path_factory, files, shards):
    """A text source (a file a document), plain or compressed: each file kept with its exact text (a
    leading BOM dropped) or quarantined with its reason, in the same bytes for any shard count."""
    folder = tmp_path_factory.mktemp("fuzz")
    (folder / "in").mkdir()
    for i, ((data, _), container) in enumerate(files):
        pack = {"": bytes, ".gz": gzip.compress, ".zst": zstandard.ZstdCompressor().compress}[container]
        (folder / "in" / f"{i:02d}.txt{container}").write_bytes(pack(data))
    src = SourceConfig(name="t", path=str(folder / "in" / "*"), format="text", domain="x", license="cc0",
                       max_doc_bytes=MAX_DOC)
    outs = []
    for n in sorted({1, shards}):
        out = folder / f"out{n}"
        out.mkdir()
        run_ingest([src], out, shards=n)
        outs.append(((out / "docs.parquet").read_bytes(), (out / "ledger.parquet").read_bytes()))
    assert outs[0] == outs[-1]
    rows = read_ledger(folder / "out1").to_pylist()
    texts = {d["id"]: d["text"] for d in iter_docs(folder / "out1")}
    assert len(rows) == len(files)
    for ((_, want), _), row in zip(files, rows, strict=True):
        if want[0] == "quarantined":
            assert (row["fate"], row["reason"]) == want, row
        else:
            assert (row["fate"], texts[row["doc_id"]]) == want, row


@FUZZ
@given(st.lists(TEXT, min_size=2, max_size=40), st.sampled_from(["truncate", "append", "delete", "replace"]),
       st.integers(1, 3))
def test_fuzzed_files_changing_while_read(tmp_path_factory, texts, how, shards):
    """A file truncated, grown, deleted or replaced after its first few bytes were read: the stage finishes,
    what it keeps is good records of one version or the other, every record is accounted for, and the
    file is named as changed (or its loss as unreadable)."""
    folder = tmp_path_factory.mktemp("fuzz")
    (folder / "in").mkdir()
    path = folder / "in" / "a.jsonl"
    path.write_bytes(b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts))
    later = [*texts[: len(texts) // 2], "appended text"]
    chunks = ingest_lines.chunks

    def meddling(p, *bound):
        for i, chunk in enumerate(chunks(p, *bound)):
            yield chunk
            if i == 0:
                _change(p, how, later)

    src = SourceConfig(name="f", path=str(folder / "in" / "*"), format="jsonl", domain="x", license="cc0",
                       max_doc_bytes=MAX_DOC)
    out = folder / "out"
    out.mkdir()
    # undone after each example (a `monkeypatch` fixture is undone after the last one: every example's
    # `meddling` would wrap the ones before it, each changing the file its own way)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ingest_lines, "CHUNK", 16)
        mp.setattr(ingest_lines, "chunks", meddling)
        stats = run_ingest([src], out, shards=shards)
    good = set(texts) | set(later)
    assert all(d["text"] in good for d in iter_docs(out))
    rows = read_ledger(out).to_pylist()
    assert stats["documents_in"] == len(rows) == stats["fates"].get("kept", 0) + stats["fates"].get(
        "quarantined", 0)
    assert stats["sources"]["f"]["changed"] == ["a.jsonl"]


def _change(path: Path, how: str, later: list[str]) -> None:
    if how == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    elif how == "append":
        with open(path, "ab") as f:
            f.write(b'{"text": "appended text"}\n')
    elif how == "delete":
        path.unlink()
    else:
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(b"".join(json.dumps({"text": t}).encode() + b"\n" for t in later))
        tmp.rename(path)


def test_regression_a_file_deleted_while_read_with_a_shard_after_it(tmp_path, monkeypatch):
    """`test_fuzzed_files_changing_while_read`'s case (found with a longer budget): a source's only file
    deleted while shard 1 of 3 reads it must leave the stage finishing. Each part of the stage once resolved
    its sources again (its key's `fetched` part and the `shard` body), so shard 2 found the source matching no
    files and failed the run; the parts now read the plan the `plan` phase made once."""
    (tmp_path / "in").mkdir()
    path = tmp_path / "in" / "a.jsonl"
    path.write_bytes(b'{"text": "0"}\n{"text": "0"}\n')
    chunks = ingest_lines.chunks

    def deleting(p, *bound):
        for i, chunk in enumerate(chunks(p, *bound)):
            yield chunk
            if i == 0:
                p.unlink()

    monkeypatch.setattr(ingest_lines, "CHUNK", 16)
    monkeypatch.setattr(ingest_lines, "chunks", deleting)
    src = SourceConfig(name="f", path=str(tmp_path / "in" / "*"), format="jsonl", domain="x", license="cc0")
    out = tmp_path / "out"
    out.mkdir()
    stats = run_ingest([src], out, shards=3)
    assert stats["documents_in"] == len(read_ledger(out).to_pylist())
    assert stats["sources"]["f"]["changed"] == ["a.jsonl"]


def test_regression_one_process_reads_a_rewritten_file_as_it_is_now(tmp_path):
    """Issue 40: two inputs through one long-lived process (this one, as hypothesis runs its examples), the
    same path, size and mtime each time: the second is read as itself, no memo of the first carried over."""
    (tmp_path / "in").mkdir()
    path = tmp_path / "in" / "a.txt"
    src = SourceConfig(name="t", path=str(path), format="text", domain="x", license="cc0", max_doc_bytes=MAX_DOC)
    fates = []
    for i, data in enumerate([b"good", b"g\xffod"]):
        path.write_bytes(data)
        os.utime(path, ns=(1_000_000_000, 1_000_000_000))
        out = tmp_path / f"out{i}"
        out.mkdir()
        run_ingest([src], out)
        fates.append([(r["fate"], r["reason"]) for r in read_ledger(out).to_pylist()])
    assert fates == [[("kept", "")], [("quarantined", "invalid_utf8")]]


def test_regression_ids_from_an_id_field_that_do_not_encode(tmp_path):
    """An `id_field` holding a lone surrogate or a non-string: an id that the ledger can write."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(b'{"id": "x\\ud800", "text": "one"}\n{"id": [1], "text": "two"}\n')
    src = SourceConfig(name="f", path=str(tmp_path / "in" / "*"), format="jsonl", domain="x", license="cc0",
                       id_field="id")
    out = tmp_path / "out"
    out.mkdir()
    run_ingest([src], out)
    assert [d["id"] for d in iter_docs(out)] == ["f/x\\ud800", "f/[1]"]


def test_regression_one_bad_line_among_good_ones(tmp_path):
    """The two lines that once failed the whole stage (issue 23): deep nesting, a lone surrogate escape."""
    good = [_good("ordinary text", True, False)] * 2
    bad = [Line(BAD["deep"][0], reason="invalid_json"),
           Line(BAD["escaped_surrogate"][0], reason="invalid_unicode")]
    corpus = Corpus([JsonlFile([good[0], *bad, good[1]], [b"\n"] * 4, True, False, "", False, "a.jsonl")])
    _lay_out(corpus, tmp_path)
    _check_jsonl(corpus, tmp_path)


def test_regression_an_overlong_line_is_quarantined_unparsed(tmp_path):
    """A line past 6 x max_doc_bytes + 1 MiB is counted, not held: quarantined `too_large`."""
    big = Line(json.dumps({"text": "w" * (6 * MAX_DOC + (1 << 20) + 10)}).encode(), reason="too_large")
    ok = _good("fine", True, False)
    corpus = Corpus([JsonlFile([ok, big, ok], [b"\n"] * 3, False, False, "", False, "a.jsonl")])
    _lay_out(corpus, tmp_path)
    _check_jsonl(corpus, tmp_path)


def test_regression_file_names_that_are_not_utf8(tmp_path):
    (tmp_path / "in").mkdir()
    name = os.fsdecode(b"bad\xffname.jsonl")
    (tmp_path / "in" / name).write_bytes(b'{"text": "kept"}\n')
    src = SourceConfig(name="f", path=str(tmp_path / "in" / "*.jsonl"), format="jsonl", domain="x",
                       license="cc0")
    out = tmp_path / "out"
    out.mkdir()
    run_ingest([src], out)
    assert [d["id"] for d in iter_docs(out)] == ["f/bad\\xffname.jsonl#L1"]


@pytest.fixture(autouse=True)
def _fifo_never_blocks():
    """A test that reads a FIFO would hang: fail it instead."""
    import signal

    def fail(*_):
        raise TimeoutError("a reader blocked (a FIFO opened?)")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(600)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@settings(FUZZ, max_examples=max(1, EXAMPLES // 5))  # each case writes and reads three bombs
@given(jsonl_files().filter(lambda f: f.container), st.integers(2, 8), st.lists(TEXT, min_size=1, max_size=6),
       st.integers(0, 6))
def test_fuzzed_decompression_bombs(tmp_path_factory, f, mb, texts, at):
    """Generated bombs of `mb` MB of zeros: a zstd frame or gzip member after a fuzzed JSONL file's lines, a
    gzip text file, and a Parquet row group at position `at` among groups of good rows. Each is quarantined
    `decompression_bomb`; every record before it keeps its text, conservation holds."""
    folder = tmp_path_factory.mktemp("fuzz")
    for name in ("j", "t", "p"):
        (folder / name).mkdir()
    from helpers import bomb

    tail = bomb(folder / f"tail{f.container}", mb << 20).read_bytes()
    (folder / "j" / f"f.jsonl{f.container}").write_bytes(f.data() + tail)
    bomb(folder / "t" / "b.txt.gz", mb << 20)
    (folder / "t" / "a.txt").write_text(texts[0])
    at = min(at, len(texts))
    rows = [*texts[:at], "x" * (mb << 20), *texts[at:]]
    pq.write_table(pa.table({"text": rows}), folder / "p" / "p.parquet", row_group_size=1, compression="zstd")
    sources = [SourceConfig(name=n, path=str(folder / n / "*"), format=fmt, domain="x", license="cc0",
                            max_doc_bytes=size) for n, fmt, size in (("j", "jsonl", MAX_DOC), ("p", "parquet", MAX_DOC),
                                                                     ("t", "text", 64 << 20))]  # not too_large first
    out = folder / "out"
    out.mkdir()
    stats = run_ingest(sources, out)
    ledger = {r["doc_id"]: r for r in read_ledger(out).to_pylist()}
    texts_out = {d["id"]: d["text"] for d in iter_docs(out)}
    expected = f.expected()
    for n, line in expected.items():
        row = ledger[f"j/f.jsonl{f.container}#L{n}"]
        if n == len(f.lines) and not f.final_newline:  # the zeros run on from the last line: the bomb cuts it
            assert row["reason"] == "decompression_bomb", row
        elif line.reason is None:
            assert (row["fate"], texts_out[row["doc_id"]]) == ("kept", line.text)
        else:
            assert (row["fate"], row["reason"]) == ("quarantined", line.reason), row
    assert ledger[f"j/f.jsonl{f.container}#rest"]["reason"] == "decompression_bomb"
    assert ledger["t/b.txt.gz"]["reason"] == "decompression_bomb"
    assert ledger[f"p/p.parquet#L{at + 1}"]["reason"] == "decompression_bomb"
    for n, text in enumerate(rows, start=1):
        if n != at + 1:
            assert texts_out[f"p/p.parquet#L{n}"] == text
    assert stats["documents_in"] == len(ledger) == stats["fates"]["kept"] + stats["fates"]["quarantined"]
    event(f"bomb after {f.container} {'a newline' if f.final_newline or not f.lines else 'a cut line'}")
