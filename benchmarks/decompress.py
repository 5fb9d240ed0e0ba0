"""Reading compressed JSONL through ingest's bounded path (`ingest.lines.chunks`) against the bare libraries
reading the same file, and the peak memory of a decompression bomb through each.

Run: `python benchmarks/decompress.py [--repeats 5] [--mb 200]`. A generated JSONL file of `--mb` MB (documents
of words drawn from a fixed vocabulary, seed 0) is compressed with zstd (level 3) and gzip (level 6); each is
read to the end by:
- moeflow: `lines.chunks` with a source's default bound (zstd fed 512 compressed bytes a call, every chunk at
  most 1 MiB, the expansion checked);
- bare: zstandard's `stream_reader` (`read_across_frames`) and `gzip.open`, read 1 MiB at a time.
Best of `--repeats`, the two alternating. Then a 16 KB zstd file expanding to 512 MB of zeros is read by
each with no bound on the ratio (moeflow: `Bound(ratio=1e12)`, so it reads all of it), and the traced peak
(`tracemalloc`) is printed, beside that of one `decompressobj().decompress` call on the whole file (what ingest
did before). What it does not show: reading from disk (the files are in the page cache), and the line
splitting and parsing that follow. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import tempfile
import time
import tracemalloc
from pathlib import Path

import zstandard

from moeflow.ingest import lines

CHUNK = 1 << 20


def _corpus(mb: int) -> bytes:
    rng = random.Random(0)
    words = ["".join(rng.choice("etaoinshrdlucmfwyp") for _ in range(rng.randint(2, 9))) for _ in range(20_000)]
    out, size, i = [], 0, 0
    while size < mb << 20:
        line = json.dumps({"id": i, "text": " ".join(rng.choices(words, k=rng.randint(50, 400)))}) + "\n"
        out.append(line)
        size, i = size + len(line), i + 1
    return "".join(out).encode()


def _bare(path: Path) -> int:
    n = 0
    if path.suffix == ".zst":
        with open(path, "rb") as f, zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True) as r:
            while chunk := r.read(CHUNK):
                n += len(chunk)
    else:
        with gzip.open(path) as g:
            while chunk := g.read(CHUNK):
                n += len(chunk)
    return n


def _ours(path: Path, bound: lines.Bound | None = None) -> int:
    return sum(len(c) for c in lines.chunks(path, bound or lines.Bound()))


def _timed(fn, path: Path) -> tuple[float, int]:
    t = time.perf_counter()
    n = fn(path)
    return time.perf_counter() - t, n


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mb", type=int, default=200)
    args = ap.parse_args()
    result: dict = {"mb": args.mb, "repeats": args.repeats}
    with tempfile.TemporaryDirectory() as tmp:
        raw = _corpus(args.mb)
        files = {".zst": zstandard.ZstdCompressor(level=3).compress(raw), ".gz": gzip.compress(raw, 6, mtime=0)}
        for suffix, data in files.items():
            path = Path(tmp) / f"c.jsonl{suffix}"
            path.write_bytes(data)
            ours, bare = [], []
            for _ in range(args.repeats):  # alternating, so a load from elsewhere falls on both alike
                ours.append(_timed(_ours, path))
                bare.append(_timed(_bare, path))
            assert ours[0][1] == bare[0][1] == len(raw)
            t_ours, t_bare = min(t for t, _ in ours), min(t for t, _ in bare)
            name = suffix.lstrip(".")
            result[name] = {"compressed_mb": round(len(data) / 2**20, 1), "moeflow_s": round(t_ours, 4),
                            "bare_s": round(t_bare, 4), "moeflow_vs_bare": round(t_bare / t_ours, 3)}
            print(f"{name}: moeflow {t_ours:.3f} s, bare {t_bare:.3f} s, speed ratio (bare time / ours) "
                  f"{t_bare / t_ours:.3f}")
        bomb = Path(tmp) / "bomb.jsonl.zst"
        c = zstandard.ZstdCompressor(level=19).compressobj()
        bomb.write_bytes(b"".join([*(c.compress(bytes(64 << 20)) for _ in range(8)), c.flush()]))
        peaks = {"moeflow": _peak(lambda: _ours(bomb, lines.Bound(ratio=1e12))), "bare_stream_reader": _peak(
            lambda: _bare(bomb)), "one_decompress_call": _peak(
            lambda: zstandard.ZstdDecompressor().decompressobj().decompress(bomb.read_bytes()))}
        result["bomb"] = {"file_bytes": bomb.stat().st_size, "expands_to": 512 << 20,
                          **{f"{k}_peak_mb": round(v / 2**20, 1) for k, v in peaks.items()}}
        print(f"bomb of {bomb.stat().st_size:,} bytes to 512 MiB, traced peak MiB: "
              + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in peaks.items()))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
