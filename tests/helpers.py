"""Test helpers: writing config variants and a small learnable training mix."""

from __future__ import annotations

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
    """A mix artifact of 96 sequences over a 300-token vocabulary with learnable structure, and its tokenizer."""
    from tokenizers.implementations import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(["abc def ghi " * 50], vocab_size=300, special_tokens=[tokenizer.EOS], show_progress=False)
    tok.save(str(root / tokenizer.TOKENIZER))
    rng = np.random.default_rng(0)
    rows = [(np.arange(33) * rng.integers(1, 7) + rng.integers(0, 50)) % tok.get_vocab_size() for _ in range(96)]
    mix._write(root / "train.arrow", rows, [[] for _ in rows], None, tok.get_vocab_size())
    return root
