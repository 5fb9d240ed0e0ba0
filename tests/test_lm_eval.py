"""The benchmark scores against lm-evaluation-harness itself, offline.

lm-eval's own task configs (its YAMLs, `!function` helpers and `process_docs` included) are given the
package's rows in place of a hub download; its `TemplateLM` encodes each request and calls a minimal
`LM` around the smoke model, one request at a time with lm-eval's truncation; its `process_results`
gives `acc` / `acc_norm`. Our side is `dedup.formats`, `moe.evaluate` (batched) and `moe.scores`, as the
`evaluate` stage runs them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moeflow import configs
from moeflow.dedup import contamination, formats
from moeflow.moe import evaluate, scores
from moeflow.tokenize import tokenizer

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra: pip install -e '.[dev]'")
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.api.task import ConfigurableTask  # noqa: E402
from lm_eval.tasks._yaml_loader import load_yaml  # noqa: E402

ITEMS = 200
TASKS = [  # (task, lm-eval YAML, benchmark of the tiny preset holding its rows)
    ("arc_easy", "arc/arc_easy.yaml", "arc"),
    ("hellaswag", "hellaswag/hellaswag.yaml", "hellaswag"),  # lm-eval's process_docs rewrites its rows
    ("winogrande", "winogrande/default.yaml", "winogrande"),  # a context per option, one continuation
]


class OneAtATime(TemplateLM):
    """lm-eval's view of the model: each (context, continuation) pair scored alone, truncated as HFLM does."""

    def __init__(self, model, tok, eos: int, window: int):
        super().__init__()
        self.model, self.tok, self.eos, self.window = model, tok, eos, window

    @property
    def eot_token_id(self) -> int:
        return self.eos

    def tok_encode(self, string: str, **kwargs) -> list[int]:
        return self.tok.encode(string, add_special_tokens=False).ids

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        out = []
        for _, ctx, cont in requests:
            inp = (ctx + cont)[-(self.window + 1):][:-1]
            logp = F.log_softmax(self.model(torch.tensor([inp]))[0][0].double(), dim=-1)
            cont = cont[-len(inp):]
            logp = logp[len(inp) - len(cont):]
            target = torch.tensor(cont)
            greedy = bool((logp.argmax(-1) == target).all())
            out.append((float(logp[torch.arange(len(cont)), target].sum()), greedy))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError


@pytest.fixture(scope="module")
def smoke_model(smoke_run):
    stages = smoke_run[1]["stages"]
    train, tok_dir = Path(stages["train"]["artifact"]), Path(stages["tokenizer"]["artifact"])
    model, tok = evaluate.load_model(train).double(), tokenizer.load(tok_dir)  # as evaluate scores
    window = json.loads((train / "model_config.json").read_text())["max_seq_len"]
    return model, tok, tok.token_to_id(tokenizer.EOS), window


def _lm_eval_task(yml: str, docs: list[dict]) -> ConfigurableTask:
    import datasets

    rows = datasets.Dataset.from_list(docs)
    cfg = load_yaml(Path(lm_eval.__file__).parent / "tasks" / yml, resolve_func=True)
    splits = datasets.DatasetDict({"train": rows, "validation": rows, "test": rows})
    cfg["custom_dataset"] = lambda **_: splits  # in place of lm-eval's hub download
    task = ConfigurableTask(config=cfg)
    task.build_all_requests(rank=0, world_size=1)
    return task


@pytest.mark.parametrize(("task", "yml", "bench"), TASKS, ids=[t for t, _, _ in TASKS])
def test_log_likelihoods_and_accuracy_match_lm_eval(smoke_model, task, yml, bench):
    model, tok, eos, window = smoke_model
    benchmark = next(b for b in configs.load("tiny").benchmarks if b.name == bench)
    docs = [(i, d) for i, m, d in contamination.records(benchmark) if formats.task_of(m) == task][:ITEMS]
    assert len(docs) == ITEMS
    ours = []
    for item_id, doc in docs:
        req = formats.request(task, doc)
        pairs = [evaluate.encode_pair(tok, c, k, eos) for c, k in zip(req["contexts"], req["continuations"],
                                                                     strict=True)]
        item = {**req, "task": task, "benchmark": bench, "item_id": item_id}
        ours.append(scores.judge(item, evaluate.loglikelihoods(model, pairs, window, torch.device("cpu"))))
    lm_task = _lm_eval_task(yml, [d for _, d in docs])
    results = OneAtATime(model, tok, eos, window).loglikelihood(lm_task.instances, disable_tqdm=True)
    by_doc: dict[int, list] = {}
    for inst, res in zip(lm_task.instances, results, strict=True):
        by_doc.setdefault(inst.doc_id, []).append((inst.idx, res, inst.doc))
    assert len(by_doc) == ITEMS
    for doc_id, rec in enumerate(ours):
        theirs = [res for _, res, _ in sorted(by_doc[doc_id], key=lambda x: x[0])]
        for mine, (ll, _) in zip(rec["loglikelihoods"], theirs, strict=True):
            assert abs(mine - ll) <= 1e-5, (task, doc_id, mine, ll)
        metrics = lm_task.process_results(by_doc[doc_id][0][2], theirs)
        shared = {m: metrics[m] for m in ("acc", "acc_norm") if m in metrics}
        assert {m: rec[m] for m in ("acc", "acc_norm") if m in rec} == shared, (task, doc_id)


def _contamination_graph(tmp_path):
    """An evaluate artifact that scored two items of one task, and a decontaminate ledger (in row groups of
    one row) that found one of them in a training document."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moeflow.core import ledger

    ev_dir, decon_dir = tmp_path / "evaluate", tmp_path / "decontaminate"
    ev_dir.mkdir(), decon_dir.mkdir()
    recs = [{"task": "arc_easy", "benchmark": "arc", "item_id": i, "loglikelihoods": [-1.0, -2.0], "gold": 0,
             "pred": 0, "acc": 1.0, "chance": 0.5} for i in ("a", "b")]
    (ev_dir / scores.ITEMS).write_text("".join(json.dumps(r) + "\n" for r in recs))
    detail = [json.dumps({"benchmark": "arc", "item_id": "b"}), "{}", "{}"]
    pq.write_table(pa.table({"id": ["d1", "d2", "d3"], "fate": ["contaminated", "kept", "kept"],
                             "reason": ["ngram", "", ""], "detail": detail}),
                   decon_dir / ledger.LEDGER, row_group_size=1)
    ev = {"_dir": str(ev_dir), "stats": {"benchmarks": {"arc_easy": {**scores.summarise(recs), "benchmark": "arc"}}},
          "config": {"benchmark_items": 2, "benchmark_seed": 0}, "code": {"source_hash": "c" * 40}}
    train = {"artifact": {"hash": "t" * 40}, "stats": {"steps": 5}}
    return ev, train, {"_dir": str(decon_dir)}


def test_the_card_splits_found_items_and_fails_without_the_per_item_records(tmp_path):
    from moeflow.card import evaluation

    ev, train, decon = _contamination_graph(tmp_path)
    assert scores.matched_items(Path(decon["_dir"])) == {("arc", "b")}
    table = evaluation.scores(ev, train, decon)
    assert table["flagged"] == ["arc_easy"] and "1 of 2 items found in training data" in table["table"]
    (Path(ev["_dir"]) / scores.ITEMS).unlink()
    with pytest.raises(FileNotFoundError, match=r"benchmarks.jsonl.*--rerun evaluate"):
        evaluation.scores(ev, train, decon)  # not a table saying "none found"


HF_TASKS = [("arc_easy", "arc/arc_easy.yaml", "arc"), ("piqa", "piqa/piqa.yaml", "piqa")]  # the smoke preset's
# transformers' Qwen2-MoE keeps its RMSNorm and router softmax in float32 even in a float64 model, so each token's
# log p agrees to float32's rounding (the export stage measures ~1e-6 a token) and a continuation's sum to that
# times its tokens: a bound of 1e-5 a token (ARC's -67.66 nats differed by 9.5e-5, PIQA's -260.38 by 1.1e-4)
HF_PER_TOKEN = 1e-5


def _tokens(req: dict, tok, eos: int) -> list[int]:
    """Each continuation's token count, as the evaluate stage encodes it."""
    return [len(evaluate.encode_pair(tok, c, k, eos)[1])
            for c, k in zip(req["contexts"], req["continuations"], strict=True)]


def test_lm_eval_hf_on_the_export_gives_evaluates_log_likelihoods_and_scores(smoke_run):
    """A second implementation checks our scores: `lm_eval --model hf` (its HFLM, the real transformers model
    loaded from the export folder, batched and truncated as lm-eval does) on the items the evaluate stage
    scored gives every item's log-likelihoods of `benchmarks.jsonl` within HF_PER_TOKEN a token, and the same
    metrics (a choice within that bound of the winner can win either way)."""
    from lm_eval.models.huggingface import HFLM

    cfg_path, summary = smoke_run
    stages = summary["stages"]
    ev_dir, export_dir = Path(stages["evaluate"]["artifact"]), Path(stages["export"]["artifact"])
    recs = [json.loads(line) for line in (ev_dir / scores.ITEMS).read_text().splitlines()]
    # `lm_eval --model hf --model_args pretrained=DIR,dtype=float64,experts_implementation=eager`: float64 as the
    # evaluate stage scores (a near tie between two choices must not flip), and transformers' eager experts
    # (its default, grouped_mm, has no float64 kernel)
    lm = HFLM(pretrained=str(export_dir), backend="causal", dtype="float64", device="cpu", batch_size=16,
              experts_implementation="eager")
    cfg = configs.load(cfg_path)
    tok = tokenizer.load(Path(stages["tokenizer"]["artifact"]))
    window = json.loads((export_dir / "config.json").read_text())["max_position_embeddings"]
    eos = tok.token_to_id(tokenizer.EOS)
    for task, yml, bench in HF_TASKS:
        benchmark = next(b for b in cfg.benchmarks if b.name == bench)
        docs = {i: d for i, m, d in contamination.records(benchmark) if formats.task_of(m) == task}
        scored = [r for r in recs if r["task"] == task]
        # lm-eval refuses a continuation longer than the window (our evaluation keeps its end): those items go
        counts = {r["item_id"]: _tokens(formats.request(task, docs[r["item_id"]]), tok, eos) for r in scored}
        mine = [r for r in scored if max(counts[r["item_id"]]) <= window]
        assert len(mine) >= 0.5 * len(scored) > 0, (task, len(mine), len(scored))  # smoke: a 64-token window
        lm_task = _lm_eval_task(yml, [docs[r["item_id"]] for r in mine])
        results = lm.loglikelihood(lm_task.instances, disable_tqdm=True)
        by_doc: dict[int, list] = {}
        for inst, res in zip(lm_task.instances, results, strict=True):
            by_doc.setdefault(inst.doc_id, []).append((inst.idx, res, inst.doc))
        accs, ties = [], 0
        for doc_id, rec in enumerate(mine):
            theirs = [res for _, res, _ in sorted(by_doc[doc_id], key=lambda x: x[0])]
            bounds = HF_PER_TOKEN * np.array(counts[rec["item_id"]], float)
            for ours, (ll, _), bound in zip(rec["loglikelihoods"], theirs, bounds, strict=True):
                assert abs(ours - ll) <= bound, (task, rec["item_id"], ours, ll, bound)
            doc = by_doc[doc_id][0][2]
            from_ours = lm_task.process_results(doc, [(ll, False) for ll in rec["loglikelihoods"]])
            assert {m: rec[m] for m in ("acc", "acc_norm")} == {m: from_ours[m] for m in ("acc", "acc_norm")}
            metrics = lm_task.process_results(doc, theirs)
            lengths = np.array([len(c) for c in formats.request(task, docs[rec["item_id"]])["choices"]], float)
            for metric, score, slack in (("acc", np.array(rec["loglikelihoods"]), bounds),
                                         ("acc_norm", np.array(rec["loglikelihoods"]) / lengths, bounds / lengths)):
                first, second = np.argsort(score)[::-1][:2]
                if score[first] - score[second] > slack[first] + slack[second]:  # no tie within the bound
                    assert metrics[metric] == rec[metric], (task, rec["item_id"], metric)
                else:
                    ties += metric == "acc"
            accs.append(metrics["acc"])
        # the task's score: lm-eval's over these items against ours, apart from ties within the tolerance
        assert abs(sum(accs) - sum(r["acc"] for r in mine)) <= ties, task
        if len(mine) == len(scored) and not ties:  # every item scored both ways: the score the card shows
            summary_acc = json.loads((ev_dir / "lineage.json").read_text())["stats"]["benchmarks"][task]["acc"]
            assert round(sum(accs) / len(accs), 4) == summary_acc, task
