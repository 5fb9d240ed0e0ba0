"""`make gpu-bundle` and the offline `make gpu-check`: no network path in the check, time boxes that hold, and
(make check) a rehearsal of a GPU run in a fresh environment holding only the image's packages and the bundle."""

from __future__ import annotations

import importlib.metadata as metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from moeflow.moe import gpu_bundle, gpu_check

ROOT = Path(__file__).resolve().parent.parent
CHECK_FILES = ["moe/gpu_check.py", "moe/gpu_tiers.py"]


def _recipe(target: str) -> str:
    text = (ROOT / "Makefile").read_text()
    return re.search(rf"^{target}:.*?(?=^\S|\Z)", text, flags=re.M | re.S).group(0)


def test_the_check_has_no_network_path():
    """The GPU machine reaches nothing: no downloads, no package manager, and pip only with --no-index."""
    sources = {f: (ROOT / f).read_text() for f in CHECK_FILES} | {"Makefile gpu-check": _recipe("gpu-check")}
    for name, text in sources.items():
        for word in ("urllib", "requests", "http", "curl", "wget", "apt", "download", "setup"):
            assert not re.search(rf"\b{word}\b", text), f"{name} mentions {word!r}"
        calls = [m.start() for m in re.finditer(r'"pip"', text)]
        assert all("--no-index" in text[at:at + 200] for at in calls), f"{name}: a pip call without --no-index"
    assert len(re.findall(r'"pip"', sources["moe/gpu_check.py"] + sources["moe/gpu_tiers.py"])) == 2


def test_a_tier_past_its_box_is_killed_and_the_others_still_report(tmp_path):
    boxes = [f"--box={t}=1" for t in ("bf16", "throughput", "megablocks")]
    proc = subprocess.run([sys.executable, "-m", "moeflow.moe.gpu_check", "--device", "cpu", "--small",
                           "--bundle", str(tmp_path / "none"), "--site", str(tmp_path / "site"), *boxes],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [x.get("tier") for x in lines[1:-1]] == list(gpu_check.BOXES)  # one line a tier, as each ends
    tiers = lines[-1]["tiers"]
    for name in ("bf16", "throughput", "megablocks"):
        assert tiers[name]["error"] == "timed out after 1 s (its time box)" and tiers[name]["seconds"] < 10
    assert tiers["cuda"]["ok"] and tiers["nccl"]["ok"] and lines[-1]["ok"] is False
    left = subprocess.run(["pgrep", "-f", "moeflow.moe.gpu_tiers"], capture_output=True, text=True).stdout
    assert left == "", "a timed-out tier left processes behind"


def test_a_bundle_for_another_python_is_refused_naming_the_fix(tmp_path):
    (tmp_path / "bundle.json").write_text(json.dumps({"python": "3.9"}))
    out = gpu_check.install(tmp_path, tmp_path / "site")
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert not out["ok"] and f"make gpu-bundle GPU_PYTHON={here}" in out["error"]


def test_the_bundle_takes_what_the_image_lacks_and_what_that_requires():
    wanted = gpu_bundle.plan({"pydantic", "numpy", "torch", "yaml"})
    assert {"pydantic", "pydantic-core", "annotated-types", "typing-inspection"} <= set(wanted)
    assert not {"numpy", "torch", "pyyaml"} & set(wanted)  # the image holds them
    assert wanted["pydantic"] == metadata.version("pydantic")  # the versions installed here


def _image_site(dest: Path) -> None:
    """The GPU image's packages as far as this environment has them: each one's top-level files linked."""
    held = gpu_bundle.image()
    dest.mkdir()
    for dist in metadata.distributions():
        if canonicalize_name(dist.metadata["Name"]) not in held:
            continue
        for top in {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            src = Path(dist.locate_file(top))
            if src.exists() and not (dest / top).exists():
                (dest / top).symlink_to(src)


def _rehearse(tmp: Path, bundle: Path) -> tuple[dict, list[dict]]:
    """A fresh venv seeing only the image's packages, `make gpu-check` through it at toy sizes on the CPU,
    every process recording its imports; (the summary line, the records)."""
    _image_site(tmp / "image")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")], check=True)
    site = next((tmp / "venv" / "lib").glob("python3*/site-packages"))
    (site / "image.pth").write_text(str(tmp / "image") + "\n")
    (tmp / "rec").mkdir()
    (tmp / "rec" / "sitecustomize.py").write_text(gpu_bundle.RECORDER)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp), "PYTHONPATH": str(tmp / "rec"),
           "MOEFLOW_IMPORT_LOG": str(tmp / "imports.jsonl"), "MOEFLOW_IMPORT_ROOT": str(ROOT.resolve())}
    cmd = ["make", "-s", "gpu-check", f"GPU_PY={tmp / 'venv/bin/python'}", f"GPU_BUNDLE={bundle}",
           f"GPU_SITE={tmp / 'site'}", "GPU_ARGS=--device cpu --small"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(x) for x in (tmp / "imports.jsonl").read_text().splitlines()]
    return json.loads(proc.stdout.splitlines()[-1]), records


@pytest.mark.check
def test_rehearsal_a_fresh_environment_runs_the_check_from_the_bundle_alone(tmp_path):
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    bundle = tmp_path / "bundle"
    made = subprocess.run(["make", "-s", "gpu-bundle", f"GPU_BUNDLE={bundle}", f"GPU_PYTHON={here}"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert made.returncode == 0, made.stderr[-3000:]
    manifest = json.loads((bundle / "bundle.json").read_text())
    assert manifest["bytes"] < gpu_bundle.LIMIT * gpu_bundle.MAX_SHARE
    summary, records = _rehearse(tmp_path, bundle)
    assert summary["bundle"]["ok"] and summary["bundle"]["wheels"] == len(manifest["wheels"])
    assert summary["ran"] and summary["ok"], summary
    assert set(summary["tiers"]["megablocks"]["built"]) == {"stanford_stk", "megablocks"}
    # every module the check's code imported came from the image or the bundle, and the bundle lists it
    owners = metadata.packages_distributions()
    listed = gpu_bundle.image() | set(manifest["wheels"])
    used = gpu_bundle.imported_modules(records)
    assert used and all(any(canonicalize_name(d) in listed for d in owners[m]) for m in used), used
    assert set(manifest["imports"]) == used
