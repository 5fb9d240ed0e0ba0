"""Test helpers: writing config variants."""

from __future__ import annotations

from pathlib import Path

import yaml

from moeflow import configs


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
