"""The export checked by loading it back: `transformers`' log-probabilities against moeflow's, the weights every
one accounted for, and `AutoTokenizer`'s ids against moeflow's tokenizer."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from moeflow.export.convert import ExportError
from moeflow.moe.evaluate import HeldOut
from moeflow.moe.model import Transformer

BATCH = 8  # held-out rows a forward pass, as evaluation's


@contextmanager
def _captured(logger_name: str):
    """The warnings `logger_name` logs inside the block (transformers reports unused or missing weights so)."""
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    log, handler = logging.getLogger(logger_name), Keep(logging.WARNING)
    log.addHandler(handler)
    try:
        yield seen
    finally:
        log.removeHandler(handler)


def load_back(folder: Path):
    """`AutoModelForCausalLM.from_pretrained(folder)` in float32 with no remote code; fails unless every tensor
    was used and none was missing, unexpected or of another shape. Returns (model, the warnings it logged)."""
    from transformers import AutoModelForCausalLM  # here: a second of imports, only the export stage's

    with _captured("transformers") as warnings:
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.float32, output_loading_info=True, trust_remote_code=False)
        except (RuntimeError, ValueError, OSError) as e:  # a tensor of the wrong shape is raised, not listed
            raise ExportError(f"export: {folder} does not load: {e} {' '.join(warnings)}") from e
    bad = {k: sorted(map(str, v)) for k, v in info.items() if v}
    if bad:
        raise ExportError(f"export: {folder} does not load as {type(model).__name__} cleanly: {bad}")
    weights = [w for w in warnings if "weight" in w.lower()]
    if weights:
        raise ExportError(f"export: loading {folder} warned about its weights: {weights}")
    return model.eval(), warnings


def positions(tokens_BS: torch.Tensor, eos: int | None) -> torch.Tensor | None:
    """`position_ids` of a document-masked model: counted from each document's EOS, as moeflow's attention
    restarts them (None: positions run across the row). transformers masks attention to each packed sequence
    it finds where the positions restart, when it is given no attention mask and no cache."""
    if eos is None:
        return None
    B, S = tokens_BS.shape
    opens = tokens_BS == eos
    at = torch.arange(S).expand(B, S)
    return at - torch.where(opens, at, 0).cummax(1).values


@torch.no_grad()
def _logprobs(model, rows_BS: torch.Tensor, eos: int | None, hf: bool) -> torch.Tensor:
    """log p of each next token [B, S - 1] under moeflow's model or the transformers one, in float64."""
    inputs = rows_BS[:, :-1]
    if hf:
        pos = positions(inputs, eos)
        logits = model(input_ids=inputs, use_cache=False, **({"position_ids": pos} if pos is not None else {})).logits
    else:
        logits = model(inputs)[0]
    lp = F.log_softmax(logits.double(), dim=-1)
    return lp.gather(-1, rows_BS[:, 1:, None]).squeeze(-1)


def compare(ours: Transformer, theirs, held: HeldOut, dev: torch.device) -> dict:
    """Per domain of the held-out set (the rows evaluation scores): both models' loss, their |difference|,
    and over every token the largest |log p difference|."""
    ours, theirs = ours.to(dev), theirs.to(dev)
    domains, worst, tokens = {}, 0.0, 0
    for domain, picked in held.picked.items():
        a, b = [], []
        for i in range(0, len(picked), BATCH):
            rows = torch.from_numpy(held.data[picked[i:i + BATCH]]).to(dev)
            a.append(_logprobs(ours, rows, ours.document_eos, hf=False).cpu())
            b.append(_logprobs(theirs, rows, ours.document_eos, hf=True).cpu())
        lp_a, lp_b = torch.cat(a), torch.cat(b)
        diff = float((lp_a - lp_b).abs().max())
        worst, tokens = max(worst, diff), tokens + lp_a.numel()
        # a row's loss is its tokens' mean, and a domain's the mean over rows: evaluation's order of means
        loss_a, loss_b = float(-lp_a.mean(1).mean()), float(-lp_b.mean(1).mean())
        domains[domain] = {"moeflow_loss": round(loss_a, 6), "transformers_loss": round(loss_b, 6),
                           "abs_loss_diff": float(f"{abs(loss_a - loss_b):.3g}"), "max_abs_logprob_diff":
                           float(f"{diff:.3g}"), "sequences": len(picked), "tokens": int(lp_a.numel())}
    return {"max_abs_logprob_diff": float(f"{worst:.3g}"), "tokens_compared": tokens, "domains": domains}


def tokenizer_agrees(folder: Path, tok, rows: np.ndarray) -> dict:
    """`AutoTokenizer.from_pretrained(folder)` against moeflow's tokenizer on the decoded held-out rows: the
    ids of each text must be the same."""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(folder)
    texts = [tok.decode(r.tolist(), skip_special_tokens=False) for r in rows]
    differ = [i for i, t in enumerate(texts)
              if auto(t, add_special_tokens=False)["input_ids"] != tok.encode(t, add_special_tokens=False).ids]
    if differ:
        raise ExportError(f"export: AutoTokenizer from {folder} encodes {len(differ)} of {len(texts)} held-out "
                          f"texts differently from moeflow's tokenizer (first: row {differ[0]})")
    return {"tokenizer_class": type(auto).__name__, "texts_compared": len(texts)}
