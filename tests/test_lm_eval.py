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
