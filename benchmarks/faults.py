"""Fault points unset: what `core.faults` costs a run that does not arm it.

Run: `python benchmarks/faults.py [--docs 200000] [--repeats 5]`.

Two figures, best of `--repeats` after a warm-up, each side timed in this process:
- per call: `faults.reached` and `faults.at` inside a stage's build scope with `MOEFLOW_FAULT` unset, against
  a bare Python function doing nothing (the floor of any call), 10^6 calls each;
- per document: reading a documents table of `--docs` rows with `core.documents.iter_docs` (which calls
  `faults.reached` once per row group) against pyarrow reading the same row groups and converting them to
  Python rows, with no call.
The last line is one JSON object. What it does not show: an armed point (it kills the process), or stages
whose bodies call the points more often than per row group (ingest: per unit read; training: per step).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import timeit
from pathlib import Path

import pyarrow.parquet as pq

from moeflow.core import faults
from moeflow.core.documents import DOCS, DocWriter, iter_docs


def _best(fn, repeats: int) -> float:
    """The least disturbed of `repeats` timed calls, after one warm-up call."""
    fn()
    return min(timeit.repeat(fn, number=1, repeat=repeats))


def _noop(*_args) -> None:
    return None


def per_call(repeats: int, n: int = 1_000_000) -> dict:
    def points():
        with faults.building("dedup", "sign", 0):
            for i in range(n):
                faults.reached(i, n)

    def bare():
        for i in range(n):
            _noop(i, n)

    p, b = _best(points, repeats), _best(bare, repeats)
    return {"calls": n, "point_ns": round(p / n * 1e9, 1), "bare_call_ns": round(b / n * 1e9, 1),
            "point_over_bare": round(p / b, 2)}


def per_document(docs: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        with DocWriter(folder) as w:
            for i in range(docs):
                w.write({"id": f"d{i}", "source": "s", "domain": "d", "path": "p", "text": f"doc {i} text"})
        f = pq.ParquetFile(folder / DOCS)

        def ours():
            with faults.building("dedup", "sign", 0):
                for _ in iter_docs(folder):
                    pass

        def bare():
            for g in range(f.num_row_groups):
                for _ in f.read_row_group(g).to_pylist():
                    pass

        o, b = _best(ours, repeats), _best(bare, repeats)
        return {"docs": docs, "row_groups": f.num_row_groups, "iter_docs_s": round(o, 4),
                "pyarrow_s": round(b, 4), "iter_docs_over_pyarrow": round(o / b, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    os.environ.pop(faults.ENV, None)
    call = per_call(args.repeats)
    print(f"per call: a point {call['point_ns']} ns, a bare call {call['bare_call_ns']} ns "
          f"({call['point_over_bare']}x)")
    doc = per_document(args.docs, args.repeats)
    print(f"{doc['docs']:,} documents in {doc['row_groups']} row groups: iter_docs {doc['iter_docs_s']} s, "
          f"pyarrow {doc['pyarrow_s']} s ({doc['iter_docs_over_pyarrow']}x)")
    print(json.dumps({**call, **doc}))


if __name__ == "__main__":
    main()
