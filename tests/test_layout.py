"""The package layout: `moeflow.tokenize` imports and never shadows the standard `tokenize` module."""

import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_stdlib_tokenize_wins_with_repo_root_on_path():
    code = (
        "import sys, tokenize, inspect, linecache; "
        "import moeflow.tokenize.mix as m; "
        "print(tokenize.__file__); print(m.__name__); inspect.getsource(m.pack)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert Path(out[0]).parent == Path(sysconfig.get_paths()["stdlib"])
    assert out[1] == "moeflow.tokenize.mix"


def test_tokenize_folder_has_no_init():
    assert not (ROOT / "tokenize" / "__init__.py").exists()


def test_cli_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "moeflow.cli", "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("run", "fetch", "up", "card", "explain"):
        assert command in out
