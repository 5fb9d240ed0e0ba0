"""`make gpu-check`: the prepared GPU verification, offline, in time-boxed tiers; one JSON line per tier and a
summary line last.

It installs the bundle `make gpu-bundle` prepared (wheels, with no index: the GPU machine reaches no
registry) into a site folder, then runs each tier of moe/gpu_tiers.py as its own process under its own time
box, so a tier that fails or hangs still leaves the others' figures. Without CUDA it says so and stops.
`--device cpu --small` runs the same code on the CPU at toy sizes, to rehearse where no GPU is lent.
This file imports only the standard library: it runs before the bundle is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import moeflow

# seconds each tier may take on the GPU; together within the 8 minutes a check may use of the machine
BOXES = {"cuda": 30, "bf16": 75, "throughput": 150, "megablocks": 180, "nccl": 30}
WHOLE = 470


def install(bundle: Path, site: Path) -> dict:
    """The bundle's wheels into an emptied `site`, from the folder alone (--no-index); its sources build in
    their tier."""
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    if not (bundle / "bundle.json").is_file():
        return {"ok": False, "error": f"no bundle at {bundle}: run `make gpu-bundle` on a machine with the "
                                      "package registries and carry the folder"}
    python = json.loads((bundle / "bundle.json").read_text())["python"]
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if python != here:
        return {"ok": False, "error": f"the bundle at {bundle} is for Python {python}, this is {here}: "
                                      f"make gpu-bundle GPU_PYTHON={here}"}
    wheels = sorted(bundle.glob("*.whl"))
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade",
           "--target", str(site), *map(str, wheels)]
    proc = subprocess.run(cmd, capture_output=True, text=True) if wheels else None
    failed = proc is not None and proc.returncode != 0
    return {"ok": not failed, "wheels": len(wheels), "seconds": round(time.perf_counter() - t0, 1),
            **({"error": proc.stderr[-1500:]} if failed else {})}


def run_tier(name: str, args: argparse.Namespace, env: dict, box: float) -> dict:
    """One tier in its own process group, killed with its children when its box runs out."""
    cmd = [sys.executable, "-m", "moeflow.moe.gpu_tiers", name, "--device", args.device,
           *(["--small"] if args.small else [])]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=box)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"ok": False, "error": f"timed out after {box:.0f} s (its time box)",
                "seconds": round(time.perf_counter() - t0, 1)}
    seconds = round(time.perf_counter() - t0, 1)
    lines = out.strip().splitlines()
    if proc.returncode or not lines:
        return {"ok": False, "error": f"exit {proc.returncode}: {err[-1500:]}", "seconds": seconds}
    return {**json.loads(lines[-1]), "seconds": seconds}


def _env(bundle: Path, site: Path) -> dict:
    """The tiers' environment: the bundle's site folder and moeflow's parent first on the path."""
    parent = str(Path(moeflow.__file__).parent.parent)
    path = [str(site), parent, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path), MOEFLOW_GPU_BUNDLE=str(bundle.resolve()),
                MOEFLOW_GPU_SITE=str(site.resolve()))


def _boxes(pairs: list[str]) -> dict:
    boxes = dict(BOXES)
    for pair in pairs:
        name, _, seconds = pair.partition("=")
        if name not in boxes or not seconds.replace(".", "", 1).isdigit():
            raise SystemExit(f"--box {pair!r}: give TIER=SECONDS with TIER one of {', '.join(BOXES)}")
        boxes[name] = float(seconds)
    return boxes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: rehearse this check")
    p.add_argument("--small", action="store_true", help="toy sizes (with --device cpu)")
    p.add_argument("--bundle", type=Path, default=Path(".gpu-bundle"), help="the folder `make gpu-bundle` made")
    p.add_argument("--site", type=Path, default=Path("/tmp/moeflow-gpu/site"), help="where the bundle installs")
    p.add_argument("--box", action="append", default=[], metavar="TIER=SECONDS", help="change a tier's time box")
    args = p.parse_args(argv)
    boxes, start = _boxes(args.box), time.perf_counter()
    summary: dict = {"bundle": install(args.bundle, args.site), "tiers": {}}
    print(json.dumps({"step": "bundle", **summary["bundle"]}), flush=True)
    env = _env(args.bundle, args.site)
    for name in BOXES:
        left = WHOLE - (time.perf_counter() - start)
        result = run_tier(name, args, env, min(boxes[name], left)) if left > 5 else \
            {"ok": False, "error": "not run: the check's 8 minutes are spent"}
        summary["tiers"][name] = result
        print(json.dumps({"tier": name, **result}), flush=True)
        if name == "cuda" and not result.get("ok"):
            summary.update(ran=False, reason=result.get("error", "the cuda tier failed"))
            break
    else:
        summary["ran"] = True
    summary["ok"] = summary["ran"] and all(t.get("ok") is not False for t in summary["tiers"].values())
    summary["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
