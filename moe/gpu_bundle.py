"""`make gpu-bundle`: the folder `make gpu-check` installs from on a GPU machine that reaches no package registry.

What goes in: every distribution the check's own code imports (the check is run here on the CPU, every process
of it recording what it loaded and which of this repository's files ran; those files' import statements name
the modules), with what they declare they require, that the GPU machine's image does not hold
(moe/gpu_image.txt), as wheels for that machine's Python at the versions installed here; and the sources
of MegaBlocks, stanford-stk and grouped_gemm, which PyPI has only as sources and which build on that machine
against its torch and CUDA. `bundle.json` lists it all. Run on a development machine, with the registries.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata as metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
IMAGE = Path(__file__).with_name("gpu_image.txt")
SOURCES = {"megablocks": "0.10.0", "stanford-stk": "0.7.1", "grouped_gemm": "0.3.0"}
INDEX = "https://pypi.org/simple"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]
LIMIT = 64 << 20  # what may travel to the GPU machine, the repository included
MAX_SHARE = 0.5  # the bundle's most: the rest is the tree's
# bundled although the image holds it: pydantic needs a recent typing_extensions and the image's version is not
# recorded; a newer one first on the check's path is backward compatible
ANYWAY = ("typing-extensions",)


def image() -> set[str]:
    """The distributions the GPU machine's image holds (canonical names)."""
    lines = IMAGE.read_text().splitlines()
    return {canonicalize_name(x.strip()) for x in lines if x.strip() and not x.startswith("#")}


RECORDER = """
import atexit, json, os, sys
def _record():
    root = os.environ["MOEFLOW_IMPORT_ROOT"]
    files = {os.path.realpath(f) for m in list(sys.modules.values())
             if os.path.isabs(f := getattr(m, "__file__", None) or "") and f.endswith(".py")}
    ours = sorted(f for f in files if f.startswith(root + os.sep) and "site-packages" not in f)
    with open(os.environ["MOEFLOW_IMPORT_LOG"], "a") as log:
        log.write(json.dumps({"loaded": sorted({m.split(".")[0] for m in sys.modules}), "ours": ours}) + "\\n")
atexit.register(_record)
"""


def record_check(folder: Path, python: str = sys.executable, env: dict | None = None) -> list[dict]:
    """Run `gpu_check --device cpu --small` with every Python process it starts recording, at exit, the
    top-level modules it loaded and the files of this repository it ran; one record a process."""
    (folder / "sitecustomize.py").write_text(RECORDER)
    log = folder / "imports.jsonl"
    env = dict(env or os.environ, MOEFLOW_IMPORT_LOG=str(log), MOEFLOW_IMPORT_ROOT=str(ROOT.resolve()))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))
    cmd = [python, "-m", "moeflow.moe.gpu_check", "--device", "cpu", "--small", "--bundle", str(folder / "none"),
           "--site", str(folder / "site")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"gpu-bundle: the check failed on the CPU:\n{proc.stderr[-2000:]}")
    return [json.loads(line) for line in log.read_text().splitlines()]


def _imports(path: Path) -> set[str]:
    """The top-level names of every absolute import in `path`, in functions too."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def imported_modules(records: list[dict]) -> set[str]:
    """The third-party modules the check's own code imported: named in an import statement of a file of this
    repository that ran, and loaded (an import in a function that never ran, or one a library tries and
    does without, does not count)."""
    loaded = set().union(*(r["loaded"] for r in records))
    files = set().union(*(r["ours"] for r in records))
    local = {Path(f).stem for f in files} | {"moeflow"}
    named = set().union(*(_imports(Path(f)) for f in files))
    return {m for m in named & loaded if m not in sys.stdlib_module_names and m not in local}


def _requirements(dist: str) -> list[str]:
    reqs = [Requirement(r) for r in metadata.requires(dist) or []]
    return [r.name for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def plan(modules: set[str]) -> dict[str, str]:
    """{distribution: version here} for what the bundle holds as wheels: the distributions of `modules` and
    what they require, less what the image holds (whose own requirements the image meets)."""
    owners = metadata.packages_distributions()
    held, todo, wanted = image() - set(ANYWAY), list(ANYWAY), {}
    for module in sorted(modules):
        if module not in owners:
            raise SystemExit(f"gpu-bundle: the check imports {module!r}, which no installed distribution "
                             "provides: install it here (make setup) first")
        todo += owners[module]
    while todo:
        dist = canonicalize_name(todo.pop())
        if dist in held or dist in wanted:
            continue
        wanted[dist] = metadata.version(dist)
        todo += _requirements(dist)
    return dict(sorted(wanted.items()))


def download_wheels(wanted: dict[str, str], out: Path, python: str) -> None:
    if not wanted:
        return
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--implementation",
           "cp", "--python-version", python, *[f"--platform={p}" for p in PLATFORMS], "-d", str(out),
           *[f"{d}=={v}" for d, v in wanted.items()]]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"gpu-bundle: pip could not fetch the wheels for Python {python}:\n{proc.stderr[-2000:]}")


def download_source(name: str, version: str, folder: Path) -> Path:
    """One source archive from the registry's simple index, its sha256 checked against the index's."""
    page = urllib.request.urlopen(f"{INDEX}/{canonicalize_name(name)}/", timeout=120).read().decode()
    stem = re.escape(f"{name.replace('-', '_')}-{version}.tar.gz").replace("_", "[-_]")
    links = re.findall(rf'href="([^"]*/({stem})#sha256=([0-9a-f]+))"', page, flags=re.I)
    if not links:
        raise SystemExit(f"gpu-bundle: {INDEX} lists no source archive of {name} {version}")
    url, filename, sha = links[0]
    data = urllib.request.urlopen(url, timeout=300).read()
    if hashlib.sha256(data).hexdigest() != sha:
        raise SystemExit(f"gpu-bundle: {filename} does not match the index's sha256: fetch it again")
    (folder / filename).write_bytes(data)
    return folder / filename


def build(out: Path, python: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    (out / "src").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        modules = imported_modules(record_check(Path(tmp)))
    wanted = plan(modules)
    download_wheels(wanted, out, python)
    sources = [download_source(n, v, out / "src").name for n, v in SOURCES.items()]
    files = sorted(p for p in [*out.glob("*.whl"), *(out / "src").glob("*.tar.gz")])
    size = sum(p.stat().st_size for p in files)
    if size > LIMIT * MAX_SHARE:
        raise SystemExit(f"gpu-bundle: {size / 2**20:.1f} MiB is over {LIMIT * MAX_SHARE / 2**20:.0f} MiB, "
                         "the share of the 64 MiB a GPU run may carry left to the bundle")
    manifest = {"python": python, "wheels": wanted, "sources": sources, "imports": sorted(modules),
                "image": IMAGE.name, "bytes": size, "files": [str(p.relative_to(out)) for p in files]}
    (out / "bundle.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(".gpu-bundle"))
    p.add_argument("--python", default="3.12", help="the GPU machine's Python, MAJOR.MINOR")
    args = p.parse_args(argv)
    manifest = build(args.out, args.python)
    print(f"{args.out}: {len(manifest['wheels'])} wheels, {len(manifest['sources'])} sources, "
          f"{manifest['bytes'] / 2**20:.1f} MiB for Python {args.python}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
