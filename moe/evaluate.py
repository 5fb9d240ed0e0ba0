"""Evaluation: held-out cross-entropy per domain on the mix's held-out sequences, and benchmark scores.

A domain's loss is measured on at most `evaluate.max_sequences_per_domain` of its held-out rows, spread across
its held-out documents (`spread`), and reports how many documents those rows cover.

Benchmark requests (`dedup.formats`) are scored as lm-evaluation-harness's causal models score them:
trailing spaces of the context move to the continuation, the two are encoded together and split at the
context's length, an input longer than the model's window keeps its right end, and a continuation's
log-likelihood is the sum over its tokens (greedy when each is the argmax); `moe.scores` turns them into
metrics.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from moeflow.configs import ConfigError, EvalConfig, ModelConfig
from moeflow.moe import device, scores
from moeflow.moe.data import sequences
from moeflow.moe.model import Transformer
from moeflow.tokenize import mix, tokenizer

BATCH = 64  # benchmark requests a forward pass


def stage(cfg: EvalConfig, inputs: dict, out: Path) -> dict:
    """The `evaluate` stage's body: the `model` input's final weights on the `mix` input's held-out set,
    and on the benchmark index's scorable items."""
    stats = run(cfg, train_dir=inputs["model"].dir, mix_dir=inputs["mix"].dir, out=out)
    if cfg.benchmark_items and "index" in inputs:
        stats["benchmarks"] = benchmarks(cfg, inputs, out)
    return stats


@torch.no_grad()
def benchmarks(cfg: EvalConfig, inputs: dict, out: Path) -> dict:
    dev = device.resolve(cfg.device or "auto")
    # float64: a request's log-likelihood must not depend on the batch it was padded into (float32 sums
    # of ~100-nat continuations differ by more than 1e-5 between batch shapes)
    model = load_model(inputs["model"].dir).to(dev).double()
    if model.cfg.output_classes is not None:
        raise ConfigError(f"evaluate: the model at {inputs['model'].dir} predicts token classes "
                          "(model.output_classes), not tokens: benchmarks score tokens; set "
                          "evaluate.benchmark_items: 0")
    tok = tokenizer.load(inputs["tokenizer"].dir)
    window = model.rope_cos.shape[0]  # the model's max_seq_len
    return score(model, tok, tok.token_to_id(tokenizer.EOS), window, dev, inputs["index"].dir,
                 cfg.benchmark_items, cfg.benchmark_seed, out)


def load_model(train_dir: Path) -> Transformer:
    meta = json.loads((Path(train_dir) / "model_config.json").read_text())
    vocab, seq_len = meta.pop("vocab_size"), meta.pop("max_seq_len")
    eos = meta.pop("document_eos", None)  # attention within documents, if trained so (absent: whole rows)
    meta.setdefault("unigram_head_bias", False)  # trained before the option existed: no bias
    model = Transformer(ModelConfig(**meta), vocab, seq_len, eos)
    model.load_state_dict(load_file(str(Path(train_dir) / "model.safetensors")), strict=True)
    return model.eval()


@torch.no_grad()
def run(cfg: EvalConfig, *, train_dir: Path, mix_dir: Path, out: Path) -> dict:
    dev = device.resolve(cfg.device or "auto")
    model = load_model(train_dir).to(dev)
    held = HeldOut(mix_dir, cfg.max_sequences_per_domain)
    read = held.read()
    results = {}
    for domain, picked in held.picked.items():
        rows = held.data[picked]
        loss = float(row_losses(model, rows, dev).mean())
        results[domain] = {
            "loss": round(loss, 4),
            "perplexity": round(math.exp(loss), 2),
            "sequences": int(len(rows)),
            "tokens": int(len(rows) * (rows.shape[1] - 1)),
            "documents": len({seg["doc_id"] for i in picked for seg in held.segments[i]}),
            "heldout_documents": read["heldout_documents"][domain],
        }
    (out / "eval.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    return {"heldout": results, **read}


class HeldOut:
    """A mix's held-out rows as evaluation reads them: per domain (`mine`), at most `cap` of its rows spread
    across its documents (`picked`)."""

    def __init__(self, mix_dir: Path, cap: int):
        path = Path(mix_dir) / "heldout.arrow"
        self.data = sequences(path)
        table = mix.read(path)
        domains = np.asarray(table.column("domain").to_pylist())
        self.segments = table.column("segments").to_pylist()
        self.mine = {d: np.flatnonzero(domains == d) for d in sorted(set(domains.tolist()))}
        self.picked = {d: m[spread([self.segments[i] for i in m], cap)] for d, m in self.mine.items()}

    def read(self) -> dict:
        """Each domain's held-out rows and the documents they hold, as the mix records them: the runner checks
        the two against its record (`Stage.counts`)."""
        return {"heldout_sequences": {d: len(m) for d, m in self.mine.items()},
                "heldout_documents": {d: len({s["doc_id"] for i in m for s in self.segments[i]})
                                      for d, m in self.mine.items()}}


@torch.no_grad()
def row_losses(model: Transformer, rows: np.ndarray, dev: torch.device) -> np.ndarray:
    """Each row's mean next-token cross-entropy (as `lm_loss` computes it), eight rows a batch."""
    out: list[float] = []
    for i in range(0, len(rows), 8):
        batch_BS = device.batch(rows[i : i + 8], dev)
        logits_BSV, _, hidden_BSD = model(batch_BS[:, :-1], return_hidden=True)
        next_BS = batch_BS[:, 1:]
        ce_BS = F.cross_entropy(logits_BSV.float().transpose(1, 2), model.targets(next_BS), reduction="none")
        if model.within is not None:  # a factored head: the token's own cross-entropy
            ce_BS = ce_BS + model.within_nll(hidden_BSD, next_BS)
        out.extend(ce_BS.mean(1).tolist())
    return np.asarray(out, dtype=np.float64)


def spread(segments: list[list[dict]], cap: int) -> np.ndarray:
    """At most `cap` of a domain's held-out rows (given by their segments), taken across its documents: each
    row belongs to the document with the most tokens in it (rows written without segments, to one unnamed
    document), the documents take turns for the places, and each document's rows are evenly spaced through
    it. Row order is kept."""
    owner = [max(segs, key=lambda s: s["length"])["doc_id"] if segs else "" for segs in segments]
    rows_of: dict[str, list[int]] = {}
    for i, doc in enumerate(owner):
        rows_of.setdefault(doc, []).append(i)
    have = np.array([len(rows_of[d]) for d in sorted(rows_of)], np.int64)
    take, want = np.zeros_like(have), min(cap, int(have.sum()))
    while take.sum() < want:  # one more row for every document that has one left, while places are left
        more = np.flatnonzero(take < have)[: want - int(take.sum())]
        take[more] += 1
    picked = [rows_of[d][j] for d, n, k in zip(sorted(rows_of), have, take, strict=True)
              for j in (np.arange(k) * n // max(k, 1)).tolist()]
    return np.array(sorted(picked), np.int64)


def encode_pair(tok, context: str, continuation: str, eos: int) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) as lm-eval's `TemplateLM._encode_pair` splits them."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
        return [eos], tok.encode(continuation, add_special_tokens=False).ids
    whole = tok.encode(context + continuation, add_special_tokens=False).ids
    ctx = tok.encode(context, add_special_tokens=False).ids
    return ctx, whole[len(ctx):]


def _hidden(model: Transformer, tokens_BS: torch.Tensor) -> torch.Tensor:
    """The LM head's input (`Transformer.features`): scoring needs logits only where a continuation is, and the
    head over a large vocabulary at every position dominates a small model."""
    return model.features(tokens_BS)[0]


@torch.no_grad()
def loglikelihoods(model, pairs: list[tuple[list[int], list[int]]], window: int,
                   dev: torch.device) -> list[tuple[float, bool]]:
    """(log-likelihood, greedy) of each continuation after its context: batches of right-padded rows of
    similar length."""
    out: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
    for b in range(0, len(order), BATCH):
        chunk = order[b:b + BATCH]
        rows = [(pairs[i][0] + pairs[i][1])[-(window + 1):][:-1] for i in chunk]
        batch = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
        for r, row in enumerate(rows):
            batch[r, :len(row)] = torch.tensor(row)
        hidden = _hidden(model, batch.to(dev))
        for r, (row, i) in enumerate(zip(rows, chunk, strict=True)):
            cont = pairs[i][1]
            n = min(len(cont), len(row))  # a continuation longer than the window: its right end
            logits = model.logits(hidden[r, len(row) - n:len(row)])  # the head, here only
            lp = F.log_softmax(logits.double(), dim=-1)
            target = torch.tensor(cont[len(cont) - n:], device=lp.device)
            out[i] = (float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))
    return out


def score(model, tok, eos: int, window: int, dev, index_dir: Path, cap: int, seed: int, out: Path) -> dict:
    """Every scorable task of the benchmark index: metrics on its sampled items, and per-item records to
    `out/benchmarks.jsonl` (the card splits them into clean and contaminated items by the lineage)."""
    table = pq.read_table(Path(index_dir) / "eval_items.parquet").to_pylist()
    tasks: dict[str, list[dict]] = {}
    for row in table:
        tasks.setdefault(row["task"], []).append(row)
    results, lines = {}, []
    for task, items in sorted(tasks.items()):
        picked = scores.sample(items, cap, seed)
        pairs = [encode_pair(tok, c, k, eos) for it in picked
                 for c, k in zip(it["contexts"], it["continuations"], strict=True)]
        lls = iter(loglikelihoods(model, pairs, window, dev))
        recs = [scores.judge(it, [next(lls) for _ in it["continuations"]]) for it in picked]
        lines += [json.dumps(r) for r in recs]
        results[task] = {"benchmark": picked[0]["benchmark"], **scores.summarise(recs)}
    (out / scores.ITEMS).write_text("\n".join(lines) + ("\n" if lines else ""))
    return results
