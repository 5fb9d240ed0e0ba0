"""One `moeflow run` of a config from a benchmark, and the stages its run record names (ladder.py, mix_search.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from moeflow import configs


def run_until(data: dict, name: str, until: str, work: Path) -> tuple[Path, dict]:
    """Write `data` as `<work>/<name>.yaml`, run it until stage `until`, and return the store's root and the
    run record's stages ({label: {"hash", "artifact", ...}})."""
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    cmd = [sys.executable, "-c", "from moeflow.cli import main; raise SystemExit(main())", "run", str(path),
           "--until", until]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{name}: moeflow run failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    root = Path(configs.load(path).store_url())
    record = max((root / "runs").glob("*.json"), key=os.path.getmtime)
    return root, json.loads(record.read_text())["stages"]
