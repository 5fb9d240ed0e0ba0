"""Test helpers: writing config variants and a small learnable training mix."""

from __future__ import annotations

import json
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
