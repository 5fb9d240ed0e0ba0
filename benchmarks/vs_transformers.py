"""moeflow's trainer and forward against transformers' on the same exported model, weights and batches.

Run: `python benchmarks/vs_transformers.py [--steps N] [--repeats R] [--threads T] [--batch B] [--seq S]`
(default 8 steps, best of 5, all cores, tiny's batch 16 x 128). For tiny's model shape (8 experts) and the same
with 64 experts (same active parameters: top-2 of experts as wide), both fp32 on the CPU:
- moeflow: a real `Trainer` (moe/train.py) on a mix of the batches, `train_step` as a run calls it (forward,
  aux losses, backward, per-group gradient norms, clipping, AdamW with its schedule);
- transformers: the export of the same initial weights (export/convert.py) as `Qwen2MoeForCausalLM`, a plain
  training step: `model(input_ids, labels=...)`, backward, `clip_grad_norm_`, `torch.optim.AdamW` with the
  same groups, betas, weight decay and per-step learning rate. The export's zero q/k/v biases and zero shared-
  expert gate (and a width-1 zero shared expert when the model has none) are frozen, so both train the same
  function; transformers' router aux loss is off and moeflow's coefficients are 0, so both minimise the same
  loss (moeflow still computes its aux terms and metrics: part of its step).
The two take turns, run by run: each run starts from the same weights and a fresh optimizer, warms up one step,
then times `--steps` steps; each figure is the fastest run of `--repeats`. Forward-only: eval mode, no grad,
the batch's logits, timed the same way. Loss curves: the per-step training loss of both over one run; their
largest difference (float32 rounding of two implementations, growing with the steps as updates compound).
The last line is one JSON object: `train_vs_transformers`, `forward_vs_transformers` (moeflow's tokens/s
over transformers', 8 experts), `train_vs_transformers_e64`, `forward_vs_transformers_e64`, tokens/s of each,
`max_loss_diff*`. What it does not show: bf16 or GPU speed (MegaBlocks' kernels are the GPU path), other
shapes, or the time to load either model; transformers' own expert implementations other than its default.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from moeflow.configs import ModelConfig, TrainConfig
from moeflow.export import convert
from moeflow.moe.optim import lr_at
from moeflow.moe.train import Trainer
from moeflow.tokenize import mix, tokenizer

TINY = {"d_model": 128, "n_layers": 2, "n_heads": 4, "num_experts": 8, "top_k": 2, "expert_hidden": 256,
        "tie_embeddings": False}
VOCAB = 8192  # tiny's tokenizer.vocab_size
FROZEN = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "shared_expert_gate.weight")


def _data(root: Path, rows: np.ndarray) -> None:
    """A mix (`train.arrow`) holding `rows` and a word-level tokenizer of VOCAB ids, as the train stage reads."""
    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {tokenizer.EOS: VOCAB - 1}
    Tokenizer(WordLevel(vocab, unk_token="t0")).save(str(root / tokenizer.TOKENIZER))
    mix.write_rows(root / "train.arrow", list(rows), [[] for _ in rows], VOCAB)


def _trainer(model: dict, cfg: TrainConfig, root: Path) -> Trainer:
    return Trainer(ModelConfig(**model), cfg, seed=0, mix_dir=root, tokenizer_dir=root, out=root / "out",
                   work=root / "out", ladder_dir=None, band_tolerance=0.0)


def _hf(trainer: Trainer, root: Path):
    """The trainer's initial weights exported and loaded as transformers' model (frozen extras, see above)."""
    from transformers import AutoModelForCausalLM

    meta = {**trainer.model_cfg.model_dump(mode="json"), "vocab_size": VOCAB, "max_seq_len": trainer.max_len}
    folder = root / "hf"
    folder.mkdir(exist_ok=True)
    save_file(convert.hf_state_dict(trainer.model.state_dict(), meta), str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(convert.hf_config(meta, VOCAB - 1)))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    shared = bool(trainer.model_cfg.shared_expert_hidden)
    for name, p in model.named_parameters():
        p.requires_grad_(not (name.endswith(FROZEN) or ".shared_expert." in name and not shared))
    return model


def _hf_optimizer(model, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW as moe/optim.py makes it: weight decay on matrices, not on the embedding, norms or biases; the same
    betas and torch's default implementation."""
    live = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in live if p.dim() >= 2 and "embed_tokens" not in n]
    rest = [p for n, p in live if not (p.dim() >= 2 and "embed_tokens" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


def _hf_step(model, opt, batch: torch.Tensor, i: int, cfg: TrainConfig) -> float:
    for g in opt.param_groups:
        g["lr"] = lr_at(i, cfg)
    opt.zero_grad(set_to_none=True)
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits  # the loss as lm_loss takes it
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], cfg.grad_clip)
    opt.step()
    return float(loss.detach())


def compare(model: dict, steps: int, repeats: int, batch: int, seq: int, threads: int) -> dict:
    """Train and forward tokens/s of both sides (best of `repeats`), and their loss curves' largest gap."""
    cfg = TrainConfig(steps=steps + 1, batch_size=batch, seq_len=seq, lr=3e-3, warmup_steps=0,
                      load_balance_coef=0.0, router_z_coef=0.0, checkpoint_every=10_000, log_every=10_000)
    rng = np.random.default_rng(0)
    rows = rng.integers(0, VOCAB - 1, ((steps + 1) * batch, seq + 1))
    batches = [torch.from_numpy(rows[i * batch:(i + 1) * batch]) for i in range(steps + 1)]
    best = {"moeflow_train": 0.0, "transformers_train": 0.0, "moeflow_forward": 0.0, "transformers_forward": 0.0}
    curves: dict[str, list[float]] = {}
    tokens = steps * batch * seq
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _data(root, rows)
        for _ in range(repeats):
            trainer = _trainer(model, cfg, root)
            torch.set_num_threads(threads)  # the trainer takes every core; the run asked for `threads`
            hf = _hf(trainer, root)
            experts = hf.config._experts_implementation  # transformers' choice for its experts' matmuls
            ours = [trainer.train_step(0).ce_sum]
            t0 = time.perf_counter()
            ours += [trainer.train_step(i).ce_sum for i in range(1, steps + 1)]
            best["moeflow_train"] = max(best["moeflow_train"], tokens / (time.perf_counter() - t0))
            opt = _hf_optimizer(hf.train(), cfg)
            theirs = [_hf_step(hf, opt, batches[0], 0, cfg)]
            t0 = time.perf_counter()
            theirs += [_hf_step(hf, opt, batches[i], i, cfg) for i in range(1, steps + 1)]
            best["transformers_train"] = max(best["transformers_train"], tokens / (time.perf_counter() - t0))
            curves = {"moeflow": ours, "transformers": theirs}
            fwd = _forward(trainer.model.eval(), hf.eval(), batches)
            for k, v in fwd.items():
                best[k] = max(best[k], v)
    gap = max(abs(a - b) for a, b in zip(curves["moeflow"], curves["transformers"]))
    return {**{k: round(v, 1) for k, v in best.items()},
            "train_ratio": round(best["moeflow_train"] / best["transformers_train"], 3),
            "forward_ratio": round(best["moeflow_forward"] / best["transformers_forward"], 3),
            "max_loss_diff": float(f"{gap:.3g}"), "first_loss": round(curves["moeflow"][0], 4),
            "transformers_experts": experts,
            "last_loss": round(curves["moeflow"][-1], 4)}


@torch.no_grad()
def _forward(ours, theirs, batches: list[torch.Tensor]) -> dict[str, float]:
    """Forward-only tokens/s over the batches (one warm-up batch each), the two taking turns batch by batch."""
    spent = {"moeflow_forward": 0.0, "transformers_forward": 0.0}
    ours(batches[0][:, :-1]), theirs(input_ids=batches[0][:, :-1], use_cache=False)
    for b in batches[1:]:
        t0 = time.perf_counter()
        ours(b[:, :-1])
        t1 = time.perf_counter()
        theirs(input_ids=b[:, :-1], use_cache=False)
        spent["moeflow_forward"] += t1 - t0
        spent["transformers_forward"] += time.perf_counter() - t1
    n = sum(b[:, :-1].numel() for b in batches[1:])
    return {k: n / v for k, v in spent.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    figures: dict = {"transformers": transformers.__version__, "threads": args.threads, "batch": args.batch,
                     "seq_len": args.seq, "steps": args.steps,
                     "repeats": args.repeats}
    for tag, model in (("", TINY), ("_e64", {**TINY, "num_experts": 64})):
        out = compare(model, args.steps, args.repeats, args.batch, args.seq, args.threads)
        print(f"{model['num_experts']} experts: train {out['moeflow_train']:,.0f} vs {out['transformers_train']:,.0f} "
              f"tokens/s ({out['train_ratio']}x), forward {out['moeflow_forward']:,.0f} vs "
              f"{out['transformers_forward']:,.0f} ({out['forward_ratio']}x), loss curves within "
              f"{out['max_loss_diff']}", flush=True)
        figures |= {f"train_vs_transformers{tag}": out.pop("train_ratio"),
                    f"forward_vs_transformers{tag}": out.pop("forward_ratio")}
        figures |= {f"{k}{tag}": v for k, v in out.items()}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
