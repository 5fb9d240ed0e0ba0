"""The package layout: `moeflow.tokenize` imports and never shadows the standard `tokenize` module."""

import argparse
import os
import re
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
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert Path(out[0]).parent == Path(sysconfig.get_paths()["stdlib"])
    assert out[1] == "moeflow.tokenize.mix"


def test_tokenize_folder_has_no_init():
    assert not (ROOT / "tokenize" / "__init__.py").exists()


def _help_commands(text: str) -> dict[str, str]:
    """The subcommands `moeflow --help` lists under COMMAND, each with its help line.

    Continuation lines are joined.
    """
    lines = text.splitlines()
    start = lines.index("  COMMAND") + 1  # the subparsers' metavar, then one indented line per command
    listed: dict[str, str] = {}
    name = None
    for line in lines[start:]:
        if not line.strip():
            break
        m = re.match(r"^ {4}(\S+)(?: {2,}(\S.*))?$", line)
        if m:
            name = m.group(1)
            listed[name] = m.group(2) or ""
        else:  # a wrapped help line, or the help of a long name on the line below it
            assert name is not None and line.startswith(" " * 5), line
            listed[name] = f"{listed[name]} {line.strip()}".strip()
    return listed


def test_cli_help_lists_every_command():
    from moeflow.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser_help = {a.dest: a.help for a in sub._choices_actions}  # the help= given to add_parser
    assert set(parser_help) == set(sub.choices)  # every command has a help= (none hidden from the listing)
    env = {**os.environ, "COLUMNS": "1000"}  # no wrapping: each help string on one line
    out = subprocess.run(
        [sys.executable, "-m", "moeflow.cli", "--help"], capture_output=True, text=True, check=True, env=env
    ).stdout
    listed = _help_commands(out)
    assert set(listed) == set(sub.choices)
    assert {"run", "why", "fetch", "up", "card", "explain"} <= set(listed)
    for name, text in listed.items():
        assert text and text == parser_help[name], (name, text)
