"""The training loop: AdamW, warmup + cosine or WSD, clipping, accumulation, checkpoints, exact resume.

Legend: B rows of a micro-batch on this rank, S stored row length (model inputs + 1).
<<<<<<< HEAD
`run` sets a `Trainer` up, then for each step: `train_step` (forward, backward, clip, update), `log`
(metrics, alarms, live table: moe/metrics.py, moe/alarms.py, moe/runlog.py) and `checkpoint_if_due`;
`finish` copies the result into the artifact. Step i reads rows [i*B, (i+1)*B) of the mix's packed
sequences (moe/data.py), so the data position is the step. Checkpoints (every `checkpoint_every` steps,
atomic) go to `work/checkpoints`; a run that finds one there resumes from it and reproduces the
uninterrupted loss curve exactly on CPU. Loss spikes, grad-norm jumps, a grad norm past its ceiling or trend
and a loss outside the ladder's band raise alarms (moe/alarms.py), each logged or stopping the run as its kind's
action says.
=======
`run` sets a `Trainer` up, then for each step: `train_step` (forward, backward, clip, update, and the experts'
bias with `model.router_bias_rate`), `log` (metrics, alarms, live table: moe/metrics.py, moe/alarms.py,
moe/runlog.py) and `checkpoint_if_due`; `finish` copies the result into the artifact. Step i reads rows [i*B,
(i+1)*B) of the mix's packed sequences (moe/data.py), so the data position is the step. Checkpoints (every
`checkpoint_every` steps, atomic) go to `work/checkpoints`; a run that finds one there resumes from it and
reproduces the uninterrupted loss curve exactly on CPU. Loss spikes and grad-norm jumps out of their recent
band raise alarms (logged; optionally stopping the run).
>>>>>>> auxfree
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moeflow.configs import ModelConfig, TrainConfig
from moeflow.core import faults
from moeflow.moe import checkpoint, device, ladder, parallel
from moeflow.moe.alarms import Alarms, Monitor
from moeflow.moe.data import Sequences
from moeflow.moe.metrics import Step, group_grad_norms, group_of, rank_metrics, restart_cost, summarise
from moeflow.moe.model import Transformer, lm_loss
from moeflow.moe.optim import adamw, lr_at
from moeflow.moe.runlog import RunLog
from moeflow.tokenize.tokenizer import EOS
from moeflow.tokenize.tokenizer import load as load_tokenizer

log = logging.getLogger(__name__)


class TrainingAlarm(RuntimeError):
    """A health alarm fired whose action is `stop`; the message names the step, the rule and its reading."""


class StopTraining(Exception):
    """Raised by `stop_after` to end a run between steps, as a kill would (tests use it)."""


def build_model(model_cfg: ModelConfig, vocab_size: int, seq_len: int, seed: int,
                document_eos: int | None = None) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(model_cfg, vocab_size, seq_len, document_eos)


def _autocast(precision: str, device_type: str):
    if precision == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return nullcontext()


@dataclass
class _Totals:
    """A step's loss terms summed over its micro-batches, and what its experts were routed."""

    ce: float = 0.0
    load_balancing: float = 0.0
    sequence_balancing: float = 0.0
    router_z: float = 0.0
    logit_z: float = 0.0
    tokens_per_expert: torch.Tensor | None = None  # [MoE layer, expert]
    dropped: int = 0


class Trainer:
    """One training run. Under torchrun (WORLD_SIZE > 1) every rank has one: each computes its slice of
    every micro-batch, rank 0 writes the records, checkpoints and artifact."""

    def __init__(self, model_cfg: ModelConfig, cfg: TrainConfig, *, seed: int, mix_dir: Path,
                 tokenizer_dir: Path, out: Path, work: Path | None, ladder_dir: Path | None,
                 band_tolerance: float):
        self.model_cfg, self.cfg, self.out = model_cfg, cfg, out
        self.dev = device.resolve(cfg.device)
        self.peak = cfg.peak_tflops or device.peak_tflops(self.dev, cfg.precision)
        self.world = parallel.init(cfg.distributed.expert_parallel, self.dev)
        self.main = self.world is None or self.world.main
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (self.world.local_size if self.world else 1)))
        self.work = Path(work or out)
        self.work.mkdir(parents=True, exist_ok=True)
        self.data = Sequences(Path(mix_dir) / "train.arrow")
        needed = cfg.steps * cfg.batch_size
        if len(self.data) < needed:
            raise ValueError(
                f"train: the mix holds {len(self.data)} sequences, {needed} are needed (steps x batch_size)"
            )
        tok = load_tokenizer(tokenizer_dir)
        self.vocab = tok.get_vocab_size()
        self.eos = tok.token_to_id(EOS) if cfg.document_mask else None
        self.max_len = max(self.data.max_len, cfg.seq_len)
        self.model = build_model(model_cfg, self.vocab, self.max_len, seed, self.eos)
        if self.model.head_bias is not None:
            self.model.init_head_bias(torch.from_numpy(self.data.token_counts(self.vocab)))
        if self.world is not None:
            self.world.shard(self.model)
        self.model.to(self.dev)
        self.opt = adamw(self.model, cfg)
        self.micro = cfg.batch_size // cfg.grad_accum
        self.local = self.micro // (self.world.size if self.world else 1)  # this rank's rows of a micro-batch
        self.offset = self.world.rank * self.local if self.world else 0
        band = ladder.Band(ladder_dir, cfg.steps, band_tolerance) if ladder_dir else None
        self.alarms = Alarms(Monitor(cfg.alarms), band, cfg.warmup_steps)
        self.ckpt_root = self.work / "checkpoints"
        self.start, self.resumed_from, self.resumes = 0, None, []

    def fit(self, stop_after: int | None = None) -> dict | None:
        self.runlog = RunLog(self.work, self.cfg, self.world, self.resume())
        if self.resumes and "recomputed_steps" not in self.resumes[-1]:
            self.resumes[-1].update(restart_cost(self.runlog.recomputed, self.model, self.cfg))
        self.alarms.replay(self.runlog.kept)
        with self.runlog.steps():
            for i in range(self.start, self.cfg.steps):
                if stop_after is not None and i >= stop_after:
                    raise StopTraining(f"stopped before step {i + 1}")
                s = self.train_step(i)
                self.log(s)
                self.checkpoint_if_due(s.number)
                faults.reached(i + 1, self.cfg.steps)  # `make chaos`: a kill point by steps
        return self.finish()

    def resume(self) -> int | None:
        """Load the latest checkpoint in `work`, if any; its step."""
        latest = checkpoint.latest(self.ckpt_root)
        if latest is None:
            return None
        state = checkpoint.load(latest, self.model, self.opt, self.world)
        self.start = self.resumed_from = state["step"]
        if self.main:
            log.warning("train: resuming from %s (step %d of %d)", latest, self.start, self.cfg.steps)
        self.resumes = state.get("resumes", []) + [{"from_step": self.start}]
        return self.start

    def train_step(self, i: int) -> Step:
        """Step i (from 0): a forward and backward pass per micro-batch, then clip and update."""
        cfg = self.cfg
        t0 = time.perf_counter()
        lr = lr_at(i, cfg)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        first = i * cfg.batch_size
        seq_len = self.data.width(first, first + cfg.batch_size) - 1  # checks the step stays in one phase
        totals = _Totals()
        for m in range(cfg.grad_accum):
            a = first + m * self.micro + self.offset
            self.forward_backward(self.data.rows(a, a + self.local), totals)
        groups, grad_norm = self.clip(totals)
        self.opt.step()
        if self.model_cfg.router_bias_rate is not None and totals.tokens_per_expert is not None:
            self.update_router_bias(totals.tokens_per_expert)
        if self.dev.type == "cuda":  # the optimizer's kernels are queued, not done: time them too
            torch.cuda.synchronize(self.dev)
        seconds = time.perf_counter() - t0
        return Step(
            number=i + 1, phase=int(self.data.phase[first]), seq_len=seq_len, lr=lr,
            micro_batches=cfg.grad_accum, ce_sum=totals.ce, load_balancing_sum=totals.load_balancing,
            sequence_balancing_sum=totals.sequence_balancing,
            router_z_sum=totals.router_z, logit_z_sum=totals.logit_z, grad_norm=grad_norm,
            grad_norm_groups=groups,
            tokens_per_expert=totals.tokens_per_expert.tolist() if totals.tokens_per_expert is not None else [],
            dropped=totals.dropped, seconds=seconds, tokens=cfg.batch_size * seq_len,
            flops_per_token=self.model.flops_per_token(seq_len), devices=self.world.size if self.world else 1,
        )

    def forward_backward(self, rows: np.ndarray, t: _Totals) -> None:
        """One micro-batch's loss and its gradient, scaled for accumulation; its terms are added to `t`."""
        cfg = self.cfg
        with _autocast(cfg.precision, self.dev.type):
            batch_BS = device.batch(rows, self.dev)
            ce, auxes, logit_z = lm_loss(self.model, batch_BS, logit_z=cfg.logit_z_coef > 0)
        lb, seq, z = (torch.stack([a[k] for a in auxes]).mean() if auxes else ce.new_zeros(())
                      for k in ("load_balancing_loss", "sequence_balancing_loss", "router_z_loss"))
        loss = (ce + cfg.load_balance_coef * lb + cfg.sequence_balance_coef * seq + cfg.router_z_coef * z
                + cfg.logit_z_coef * logit_z)
        (loss / cfg.grad_accum).backward()
        dropped = torch.stack([a["dropped"] for a in auxes]).sum() if auxes else ce.new_zeros(())
        # one host sync for the micro-batch's terms (one per term and layer costs a GPU its queue)
        values = torch.stack([v.detach().float() for v in (ce, lb, seq, z, logit_z, dropped)]).tolist()
        t.ce, t.load_balancing, t.sequence_balancing, t.router_z, t.logit_z = (
            t.ce + values[0], t.load_balancing + values[1], t.sequence_balancing + values[2],
            t.router_z + values[3], t.logit_z + values[4]
        )
        t.dropped += round(values[5])
        if auxes:
            counts = torch.stack([a["tokens_per_expert"] for a in auxes])
            t.tokens_per_expert = counts if t.tokens_per_expert is None else t.tokens_per_expert + counts

    def clip(self, t: _Totals) -> tuple[dict[str, float], float]:
        """Clip the gradients by the whole model's norm; (norm per parameter group, norm) before clipping.

        Under torchrun the gradients are reduced first, and `t` becomes the mean over ranks.
        """
        if self.world is None:
            groups = group_grad_norms(self.model)
            return groups, float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
        self.world.reduce_gradients(self.model)
        squares = self.world.grad_square_sums(self.model, group_of)
        total = math.sqrt(sum(squares.values()))
        torch.nn.utils.clip_grads_with_norm_(
            [p for p in self.model.parameters() if p.grad is not None], self.cfg.grad_clip, torch.tensor(total)
        )
        groups = {g: round(math.sqrt(v), 5) for g, v in sorted(squares.items())}
        means = self.world.mean([t.ce, t.load_balancing, t.sequence_balancing, t.router_z, t.logit_z, t.dropped])
        t.ce, t.load_balancing, t.sequence_balancing, t.router_z, t.logit_z = means[:5]
        t.dropped = round(means[5] * self.world.size)
        return groups, total

    def update_router_bias(self, tokens_per_expert_LE: torch.Tensor) -> None:
        """Move each MoE layer's expert bias towards its mean load over the step (`model.router_bias_rate`).

        The counts are every rank's (the layer all-reduces them), so the ranks' biases stay identical."""
        routers = [block.moe.router for block in self.model.blocks if hasattr(block, "moe")]
        for router, load_E in zip(routers, tokens_per_expert_LE, strict=True):
            router.update_bias(load_E)

    def log(self, s: Step) -> None:
        """The step's record and alarms (stopping the run on one if the config says so)."""
        record = s.record(self.cfg, self.peak)
        if self.world is not None:
            record["ranks"] = rank_metrics(self.world, s.seconds, len(s.tokens_per_expert))
        alarms = self.alarms.check(s, record)
        for alarm in alarms:  # every rank sees the same values, so every rank decides the same
            action = self.cfg.alarms.action(alarm.rule)
            self.runlog.alarm(s.number, alarm, action)
            if action == "stop":
                raise TrainingAlarm(f"step {s.number}: {alarm.text} (action: stop)")
        self.runlog.step(s, record, [a.text for a in alarms])

    def checkpoint_if_due(self, step: int) -> None:
        if step % self.cfg.checkpoint_every == 0 or step == self.cfg.steps:
            checkpoint.save(
                self.ckpt_root,
                step,
                self.model,
                self.opt,
                {"data_position": step * self.cfg.batch_size, "resumes": self.resumes},
                self.cfg.keep_checkpoints,
                self.world,
            )

    def finish(self) -> dict | None:
        """On rank 0: the final checkpoint, metrics and event files into the artifact; the run's summary."""
        if not self.main:
            return None
        self.runlog.close()
        meta = {**self.model_cfg.model_dump(mode="json"), "vocab_size": self.vocab, "max_seq_len": self.max_len}
        _publish(self.work, self.out, meta if self.eos is None else {**meta, "document_eos": self.eos})
        records = [json.loads(line) for line in (self.out / "metrics.jsonl").read_text().splitlines()]
        summary = summarise(
            records, self.model, self.model_cfg, self.cfg, vocab=self.vocab, max_len=self.max_len,
            resumes=self.resumes, resumed_from=self.resumed_from, alarms=self.runlog.alarms,
        )
        return {**summary, "device": device.describe(self.dev), "peak_tflops": self.peak}


def _publish(work: Path, out: Path, model_config: dict) -> None:
    """Copy the final checkpoint, metrics and event files from `work` into the artifact `out`."""
    final = checkpoint.latest(work / "checkpoints")
    if work != out:
        shutil.copytree(final, out / "checkpoint")
        shutil.copy(work / "metrics.jsonl", out / "metrics.jsonl")
        shutil.copytree(work / "tensorboard", out / "tensorboard")
        shutil.copy(work / "alarms.jsonl", out / "alarms.jsonl")
    shutil.copy(final / "model.safetensors", out / "model.safetensors")
    (out / "model_config.json").write_text(json.dumps(model_config, indent=2, sort_keys=True))


def run(
    model_cfg: ModelConfig,
    cfg: TrainConfig,
    *,
    seed: int,
    mix_dir: Path,
    tokenizer_dir: Path,
    out: Path,
    work: Path | None = None,
    stop_after: int | None = None,
    ladder_dir: Path | None = None,
    band_tolerance: float = 0.05,
) -> dict | None:
    """Train and return the run's summary; under torchrun (WORLD_SIZE > 1) every rank calls this, rank 0
    writes the metrics, checkpoints and artifact and returns the summary, the others return None."""
    trainer = Trainer(model_cfg, cfg, seed=seed, mix_dir=mix_dir, tokenizer_dir=tokenizer_dir, out=out,
                      work=work, ladder_dir=ladder_dir, band_tolerance=band_tolerance)
    return trainer.fit(stop_after)
