"""The code part of a stage's key: a normalised hash of the moeflow modules a body reaches by import.

A module's hash is taken over its syntax tree with docstrings removed (comments never reach the tree),
so editing a comment or a docstring changes no key, while editing any statement does. The modules
counted are the body's own and every moeflow module it imports, at any depth and from inside
functions too (an import anywhere in the file counts), with the packages that hold them.
Library versions that shape a stage's output are taken from the installed distributions.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.metadata
import json
import os
import sys
import threading
from pathlib import Path

import xxhash

from moeflow.core.paths import PACKAGE_ROOT

PACKAGE = "moeflow"
# Modules that are data, not code: the registry's pins and extraction rules enter a stage's key as the
# fetched identities of the packages it reads, so a bumped pin rebuilds only the stages reading it.
DATA_MODULES = frozenset({"moeflow.sources.registry"})
# Modules that only report (live progress in the Prefect UI) and never shape an artifact: not in keys.
REPORTING_MODULES = frozenset({"moeflow.core.progress", "moeflow.moe.live"})
# Plumbing: modules that fetch, move or locate bytes whose content is checked against a hash where it
# arrives (the artifact store, its mirror and leases; fetching packages). What they carry is keyed already,
# as the inputs' content hashes and the fetched files' identities, so editing them rebuilds nothing.
# (`store.format` stays keyed: its checksums are written into the `sources` stage's output.)
PLUMBING_MODULES = frozenset({
    "moeflow.sources.fetch", "moeflow.store.mirror", "moeflow.store.local", "moeflow.store.remote",
    "moeflow.store.lease", "moeflow.store.url", "moeflow.store.gc",
})
UNKEYED = DATA_MODULES | REPORTING_MODULES | PLUMBING_MODULES


def module_file(module: str) -> Path | None:
    """The file of a moeflow module or package (`__init__.py`); None for a namespace folder or a name
    that is not a module (an attribute imported with `from pkg import name`)."""
    base = PACKAGE_ROOT.joinpath(*module.split(".")[1:])
    if module != PACKAGE and base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    init = base / "__init__.py"
    return init if init.is_file() else None


def _is_module(module: str) -> bool:
    parts = module.split(".")[1:]
    base = PACKAGE_ROOT.joinpath(*parts)
    return base.with_suffix(".py").is_file() or base.is_dir()


def _imported(module: str, tree: ast.AST) -> list[str]:
    """Every name a module's tree imports, relative ones made absolute, and `x.y` for each `from x import y`
    (a module or an attribute: `_moeflow_modules` tells)."""
    path = module_file(module)
    here = module if path is not None and path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return sorted(found)


def _moeflow_modules(names: list[str]) -> set[str]:
    """The moeflow modules among imported `names`, with their parent packages."""
    out = set()
    for name in names:
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            parts = name.split(".")
            out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {m for m in out if _is_module(m) or m == PACKAGE}


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


@functools.cache
def _parsed(module: str) -> tuple[str, frozenset[str]]:
    """(normalised hash, imported moeflow modules) of one module; a namespace folder hashes as empty."""
    path = module_file(module)
    if path is None:
        return "", frozenset()
    source = path.read_bytes()
    key = [path.relative_to(PACKAGE_ROOT).as_posix(), xxhash.xxh3_64_hexdigest(source)]
    known = _known()
    if known.get(module, [None, None])[:2] != key:
        tree = ast.parse(source, filename=str(path))
        names = _imported(module, tree)
        dump = ast.dump(_strip_docstrings(tree), annotate_fields=False, include_attributes=False)
        known[module] = [*key, xxhash.xxh3_64_hexdigest(dump.encode()), names]
        _changed.add(module)
    return known[module][2], frozenset(_moeflow_modules(known[module][3]))


# `_parsed`'s results are kept across processes: every fresh worker parsed the ~30 modules a data stage
# reaches before its first part (0.1-0.25 s). The file sits in the package's `__pycache__`, beside Python's
# own compiled modules, named by this file's bytes (the normalisation) and the Python version (the trees'
# shape); an entry holds its module's path and source hash and is used only while both match, so it is
# what parsing the module would give. Not writable (an installed package): parsed as before.
_changed: set[str] = set()
_lock = threading.Lock()


@functools.cache
def _known() -> dict[str, list]:
    """The entries of the file: module -> [path, source hash, normalised hash, imported names]."""
    try:
        data = json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if _entry(v)} if isinstance(data, dict) else {}


def _entry(v) -> bool:
    return (isinstance(v, list) and len(v) == 4 and all(isinstance(x, str) for x in v[:3])
            and isinstance(v[3], list) and all(isinstance(x, str) for x in v[3]))


def _cache_file() -> Path:
    tag = xxhash.xxh3_64_hexdigest(Path(__file__).read_bytes() + sys.version.encode())
    return PACKAGE_ROOT / "__pycache__" / f"code-hashes.{tag}.json"


def _save() -> None:
    """Write the parsed modules' entries (with the others the file held) in place of the file, atomically."""
    if not _changed:
        return
    path = _cache_file()
    with contextlib.suppress(OSError):
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(_known(), sort_keys=True))
        os.replace(tmp, path)
        _changed.clear()


@functools.cache
def closure(module: str) -> dict[str, str]:
    """Every moeflow module `module` reaches by import, itself included -> its normalised hash."""
    seen: dict[str, str] = {}
    todo = [module]
    with _lock:  # threads of one process share the entries (`_known`)
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            digest, imports = _parsed(name)
            seen[name] = digest
            todo += sorted(imports - set(seen) - UNKEYED)
        _save()
    return {k: seen[k] for k in sorted(seen) if seen[k]}


def libraries(names: tuple[str, ...]) -> dict[str, str]:
    """Installed versions of the distributions `names` ("absent" when one is not installed)."""
    return {name: _version(name) for name in names}


@functools.cache
def _version(name: str) -> str:
    """A distribution's version, read once per process (reading its metadata costs milliseconds, and every
    part of a sharded stage keys on it): what this process imported stays what it runs."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"
