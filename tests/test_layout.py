"""The package layout: `moeflow.tokenize` imports and never shadows the standard `tokenize` module."""

import argparse
import ast
import json
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


def test_the_layers_contract_names_every_tokenize_module():
    """The contract lists tokenize/'s modules one by one (pyproject.toml says why): a module added there must
    be added to its layer, or the contract would not check it."""
    import tomllib

    layers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    listed = next(layer for layer in layers if "moeflow.tokenize." in layer)
    on_disk = {f"moeflow.tokenize.{p.stem}" for p in (ROOT / "tokenize").glob("*.py")}
    assert {m.strip() for m in listed.split(":")} == on_disk
    assert not [p for p in (ROOT / "tokenize").iterdir() if p.is_dir() and p.name != "__pycache__"]


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


def test_cli_stage_help_names_every_stage_in_dag_order():
    from moeflow.cli.main import STAGE_HELP
    from moeflow.tasks.registry import STAGES

    assert STAGE_HELP.split(", ") == list(STAGES)


def _imports(tmp_path) -> dict[str, set[str]]:
    """Module -> the moeflow modules it imports (inside functions too), from grimp, the graph import-linter
    checks. `moeflow.tokenize` is a namespace folder, so it is a root of its own, and grimp names its modules
    from the path entry they are found under: a folder holding a link `moeflow` to the repository, as
    `make test` gives `lint-imports`."""
    (tmp_path / "moeflow").symlink_to(ROOT)
    code = ("import json, grimp; g = grimp.build_graph('moeflow', 'moeflow.tokenize', cache_dir=None); "
            "print(json.dumps({m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}))")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True).stdout
    graph = {m: set(n) for m, n in json.loads(out).items()}
    assert "moeflow.tokenize.mix" in graph and "moeflow.store.local" in graph, sorted(graph)
    return graph


def test_no_module_imports_itself_through_others(tmp_path):
    """No file-level import cycle, a package's `__init__.py` with its own modules included (import-linter's
    acyclic_siblings contract checks siblings only)."""
    graph = _imports(tmp_path)
    modules = sorted(graph)
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(m: str) -> None:  # Tarjan's strongly connected components
        index[m] = low[m] = len(index)
        stack.append(m)
        on.add(m)
        for n in sorted(graph[m]):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                on.discard(n)
                component.append(n)
                if n == m:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for m in modules:
        if m not in index:
            visit(m)
    assert cycles == [], f"modules that import each other: {cycles}"


MAX_FUNCTION_LINES = 60


def test_functions_fit_on_one_screen():
    found = set()
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", ".venv", "build") or rel.parts[0].startswith("."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    found.add(f"{rel.as_posix()}:{node.name}")
    assert not found, f"over {MAX_FUNCTION_LINES} lines: {sorted(found)}"
