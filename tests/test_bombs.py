"""Decompression bombs: no read returns more than a bounded chunk, and a compressed input expanding past its
source's bound is quarantined `decompression_bomb`, naming the file, while the rest of the source is kept."""

import gzip
import json
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from helpers import bomb, run_ingest
from moeflow.configs import SourceConfig
from moeflow.core.documents import iter_docs
from moeflow.core.ledger import read as read_ledger
from moeflow.ingest import lines
from moeflow.ingest.errors import DecompressionBomb

GOOD = [json.dumps({"text": f"an ordinary document, number {i}"}).encode() + b"\n" for i in range(3)]


@pytest.mark.parametrize("suffix", [".zst", ".gz"])
def test_no_chunk_is_larger_than_the_chunk_size_and_memory_stays_flat(tmp_path, suffix):
    """512 MB of zeros from a few hundred KB, read with no bound on the ratio: every chunk at most `CHUNK`,
    and the traced peak a small part of what the file expands to (one zstd call returned it all at once)."""
    path = bomb(tmp_path / f"z{suffix}", 512 << 20)
    tracemalloc.start()
    try:
        sizes = [len(c) for c in lines.chunks(path, lines.Bound(ratio=1e12))]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sum(sizes) == 512 << 20
    assert max(sizes) <= lines.CHUNK
    assert peak < 48 << 20, f"peak {peak:,} bytes"


@pytest.mark.parametrize("suffix", [".zst", ".gz"])
def test_a_bomb_stops_early_after_the_chunks_before_it(tmp_path, suffix):
    head = b"".join(GOOD)
    path = bomb(tmp_path / f"z{suffix}", 1 << 30, head=head)
    read = b""
    with pytest.raises(DecompressionBomb, match=rf"z\{suffix} expands past [\d,]+ bytes from [\d,]+ compressed"):
        for chunk in lines.chunks(path, lines.Bound()):
            read += chunk
    assert read.startswith(head)
    assert len(read) < 64 << 20  # stopped long before the 1 GB: at about 100x the compressed size


def test_the_size_cap_and_a_raised_ratio(tmp_path):
    """`max_decompressed_bytes` stops a file at any ratio; a ratio raised past the file's lets it through."""
    path = bomb(tmp_path / "z.gz", 8 << 20)
    with pytest.raises(DecompressionBomb, match="max_decompressed_bytes"):
        list(lines.chunks(path, lines.Bound(ratio=1e6, size=4 << 20)))
    assert sum(map(len, lines.chunks(path, lines.Bound(ratio=1e6)))) == 8 << 20
    small = tmp_path / "small.gz"
    small.write_bytes(gzip.compress(bytes(1 << 20)))  # 1,000x, but no more than FLOOR: never a bomb
    assert sum(map(len, lines.chunks(small, lines.Bound()))) == 1 << 20


def _src(tmp_path, name, pattern, fmt, **kw):
    return SourceConfig(name=name, path=str(tmp_path / name / pattern), format=fmt, domain="web", license="cc0",
                        **kw)


def test_bombs_of_every_format_are_quarantined_and_the_rest_of_each_source_kept(tmp_path):
    """A zstd and a gzip JSONL bomb after good lines, a gzip bomb in a text source, a Parquet row group whose
    footer gives it 64 MB from a few KB, and a `datasets` JSON file that is a gzip bomb: each quarantined
    `decompression_bomb` with the file named, every other record kept, every record accounted for."""
    for name in ("j", "t", "p", "h"):
        (tmp_path / name).mkdir()
    (tmp_path / "j" / "good.jsonl").write_bytes(b"".join(GOOD))
    good_zst = zstandard.ZstdCompressor().compress(b"".join(GOOD))
    bomb(tmp_path / "j" / "frames.jsonl.zst", 1 << 30)
    (tmp_path / "j" / "frames.jsonl.zst").write_bytes(good_zst + (tmp_path / "j" / "frames.jsonl.zst").read_bytes())
    bomb(tmp_path / "j" / "z.jsonl.gz", 1 << 30, head=GOOD[0])
    (tmp_path / "t" / "a.txt").write_text("an ordinary text file")
    bomb(tmp_path / "t" / "b.txt.gz", 1 << 30)
    table = pa.table({"text": ["row one", "row two", "a" * (64 << 20), "row four"]})
    pq.write_table(table, tmp_path / "p" / "x.parquet", row_group_size=2, compression="zstd")
    with pq.ParquetFile(tmp_path / "p" / "x.parquet") as f:
        assert f.metadata.num_row_groups == 2  # rows 3 and 4 share the bomb's group
    bomb(tmp_path / "h" / "d.json.gz", 256 << 20, head=GOOD[0])
    sources = [_src(tmp_path, "j", "*", "jsonl"), _src(tmp_path, "t", "*", "text"),
               _src(tmp_path, "p", "*.parquet", "parquet", max_doc_bytes=100 << 20),
               _src(tmp_path, "h", "*", "hf_files", builder="json")]
    out = tmp_path / "out"
    out.mkdir()
    stats = run_ingest(sources, out)

    rows = {r["doc_id"]: (r["fate"], r["reason"], r["detail"]) for r in read_ledger(out).to_pylist()}
    bombs = {k: d for k, (fate, why, d) in rows.items() if why == "decompression_bomb"}
    assert sorted(bombs) == ["h/d.json.gz", "j/frames.jsonl.zst#L4", "j/frames.jsonl.zst#rest", "j/z.jsonl.gz#L2",
                             "j/z.jsonl.gz#rest", "p/x.parquet#L3", "p/x.parquet#L4", "t/b.txt.gz"]
    for doc_id, detail in bombs.items():
        assert doc_id.split("/")[1].split("#")[0] in detail and "max_expansion" in detail, detail
    kept = {k for k, (fate, _, _) in rows.items() if fate == "kept"}
    assert kept == {"j/good.jsonl#L1", "j/good.jsonl#L2", "j/good.jsonl#L3", "j/frames.jsonl.zst#L1",
                    "j/frames.jsonl.zst#L2", "j/frames.jsonl.zst#L3", "j/z.jsonl.gz#L1", "t/a.txt", "p/x.parquet#L1",
                    "p/x.parquet#L2"}
    assert len(rows) == stats["documents_in"] == stats["fates"]["kept"] + stats["fates"]["quarantined"]
    assert sum(1 for _ in iter_docs(out)) == len(kept)


@pytest.mark.parametrize("name", ["own.jsonl.gz", "own.jsonl.zst"])
def test_your_own_eval_set_that_is_a_bomb_is_an_error_naming_it(tmp_path, name):
    """Your own benchmark file is read through the same bounded path: a bomb fails with the file named (it
    was read whole, a line at a time, so a bomb of one line was held whole), and a good compressed one reads."""
    from moeflow.configs import BenchmarkConfig
    from moeflow.dedup import contamination

    path = bomb(tmp_path / name, 1 << 30, head=b'{"text": "q"}\n')
    with pytest.raises(ValueError, match=rf"benchmark 'own': .*{name} cannot be read as an eval set: "
                                         r"DecompressionBomb: .*max_expansion"):
        list(contamination.records(BenchmarkConfig(name="own", path=str(path))))
    good = tmp_path / f"good-{name}"
    raw = b"".join(GOOD)
    good.write_bytes(gzip.compress(raw) if name.endswith(".gz") else zstandard.ZstdCompressor().compress(raw))
    items = list(contamination.records(BenchmarkConfig(name="own", path=str(good))))
    assert [doc["text"] for _, _, doc in items] == [json.loads(line)["text"] for line in GOOD]
