"""Test helpers: writing config variants, a small learnable training mix, and stages run through the runner
(`tasks.runner.materialize`) in a throwaway store."""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import yaml

from moeflow import configs
from moeflow.tokenize import mix, tokenizer


def write_config(path: Path, base: str = "smoke", **overrides) -> Path:
    """Write `base` with top-level sections replaced (dicts merged one level) to `path`."""
    data = yaml.safe_load(configs.resolve(base).read_text())
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def write_training_mix(root: Path) -> Path:
    """A mix artifact of 96 sequences over a 300-token vocabulary, and its tokenizer.

    The sequences have learnable structure.
    """
    from tokenizers.implementations import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(
        ["abc def ghi " * 50], vocab_size=300, special_tokens=[tokenizer.EOS], show_progress=False
    )
    tok.save(str(root / tokenizer.TOKENIZER))
    rng = np.random.default_rng(0)
    rows = [
        (np.arange(33) * rng.integers(1, 7) + rng.integers(0, 50)) % tok.get_vocab_size() for _ in range(96)
    ]
    mix.write_rows(root / "train.arrow", rows, [[] for _ in rows], tok.get_vocab_size())
    return root


def write_large_jsonl(path: Path, size: int, unique: int = 1000, words: int = 3000, seed: int = 0) -> int:
    """A JSONL source of about `size` bytes: `unique` distinct documents of `words` made-up words (about
    6.5 bytes a word; distinct enough not to be near-duplicates), then copies of them in shuffled rounds,
    each copy with its own id; returns the line count."""
    rng = np.random.default_rng(seed)
    syllables = [
        "ka",
        "lo",
        "mi",
        "ne",
        "ru",
        "ta",
        "vo",
        "shi",
        "pre",
        "den",
        "gar",
        "bel",
        "tor",
        "qu",
        "ix",
        "an",
    ]
    vocab = np.array(["".join(rng.choice(syllables, size=rng.integers(1, 4))) for _ in range(20_000)])
    docs = []
    for i in range(unique):
        drawn = vocab[rng.integers(0, len(vocab), size=words)]
        text = ".\n".join(" ".join(drawn[j : j + 15]) for j in range(0, len(drawn), 15))
        docs.append((json.dumps({"id": f"u{i}", "text": text.capitalize()}) + "\n").encode())
    block = b"".join(docs)
    lines = 0
    with open(path, "wb") as f:
        f.write(block)
        lines += unique
        while f.tell() < size:
            order = rng.permutation(unique)
            f.write(b"".join(docs[i].replace(b'"id": "u', b'"id": "r%d-u' % lines, 1) for i in order))
            lines += unique
    return lines


def bomb(path: Path, expands_to: int, head: bytes = b"") -> Path:
    """A compressed file by `path`'s extension (.zst, .gz) holding `head` and then `expands_to` zero bytes,
    written a block at a time (a 20 GB zstd bomb is about 640 KB, written in seconds)."""
    import zlib

    import zstandard

    c = zstandard.ZstdCompressor(level=1).compressobj() if path.suffix == ".zst" else zlib.compressobj(
        9, zlib.DEFLATED, 31)
    block = bytes(64 << 20)
    with open(path, "wb") as f:
        f.write(c.compress(head))
        for left in range(expands_to, 0, -len(block)):
            f.write(c.compress(block[:left]))
        f.write(c.flush())
    return path


def join_parts(folder: Path, n: int, build, merge, cfg=None, phase: str = "shard") -> tuple[Path, dict]:
    """A one-phase sharded stage run by hand: `build(out, (rank, n))` per shard, then `merge`; returns the
    joined folder and its stats."""
    parts = []
    for rank in range(n):
        part = folder / f"part{rank}"
        part.mkdir(parents=True)
        (part / "manifest.json").write_text(json.dumps({"stats": build(part, (rank, n))}))
        parts.append(part)
    joined = folder / "joined"
    joined.mkdir()
    return joined, merge(cfg, {phase: parts}, joined)


def manifest_of(entry: dict) -> dict:
    """The manifest of a run record's stage entry, from a local store or an object store."""
    from moeflow.store.format import is_remote
    from moeflow.store.url import store_for

    if is_remote(entry["artifact"]):
        url, stage, _, _ = entry["artifact"].rsplit("/", 3)
        return store_for(url).get(stage, entry["hash"]).to_dict()
    return json.loads((Path(entry["artifact"]) / "manifest.json").read_text())


@functools.cache
def _smoke() -> configs.RunConfig:
    return configs.load("smoke")  # once: the fuzz tests run a stage hundreds of times


def stage_config(store: Path, shards: int = 1, **fields) -> configs.RunConfig:
    """The smoke preset with its store at `store`, `execution.shards` = `shards` and the top-level `fields`
    replaced as they are (not validated against the rest: `sources` need not match the preset's mix)."""
    cfg = _smoke()
    execution = cfg.execution.model_copy(update={"shards": shards})
    return cfg.model_copy(update={"store": str(store), "execution": execution, **fields})


def docs_artifact(store: Path, folder: Path):
    """`folder`'s files (docs.parquet, and a ledger if there is one) sealed into the store at `store` as a
    `filter` artifact recording its documents as its output, as an input for a stage that takes `docs`."""
    from moeflow.core.documents import count_docs
    from moeflow.store.format import file_xxh3
    from moeflow.store.local import Store

    s = Store(store)
    tmp = s.staging("filter")
    for f in sorted(Path(folder).iterdir()):
        if f.is_file():
            shutil.copyfile(f, tmp / f.name)
    n = count_docs(tmp)
    key = file_xxh3(tmp / "docs.parquet")
    stats = {"documents_in": n, "documents_out": n, "fates": {"kept": n}}
    lineage = {"stage": "filter", "config": {}, "inputs": {}, "started_at": "t", "finished_at": "t"}
    return s.commit("filter", key, tmp, stats, lineage)


def _fresh_store(out: Path) -> Path:
    """A new, empty store beside `out`: the joined artifact's key leaves the part counts out, so a store
    that held the stage already would hand back the artifact of another shard count."""
    out = Path(out)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}-store-", dir=out.parent))


def _into(manifest, out: Path) -> dict:
    """The artifact's files copied into `out`; its stats."""
    for rel in manifest.files:
        (Path(out) / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(manifest.dir / rel, Path(out) / rel)
    return manifest.stats


def run_ingest(sources, out: Path, shards: int = 1) -> dict:
    """The `ingest` stage of `sources` (SourceConfigs) run by `tasks.runner.materialize` in `shards` record
    shards, in a fresh store beside `out`; its files copied into `out` (which exists); returns its stats."""
    from moeflow.tasks.runner import materialize

    cfg = stage_config(_fresh_store(out), shards, sources=tuple(sources))
    return _into(materialize("ingest", cfg, {}), out)


def run_dedup(dedup: configs.DedupConfig, docs: Path, out: Path, shards: int = 1) -> dict:
    """The `dedup` stage with config `dedup` of the documents in folder `docs` run by `tasks.runner.materialize`
    in `shards` record shards (the `pairs` phase: `dedup.partitions`), in a fresh store beside `out`; its files
    copied into `out` (which exists); returns its stats."""
    from moeflow.tasks.runner import materialize

    store = _fresh_store(out)
    cfg = stage_config(store, shards, dedup=dedup)
    return _into(materialize("dedup", cfg, {"docs": docs_artifact(store, docs)}), out)
