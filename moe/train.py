"""The training loop: AdamW, warmup + cosine or WSD, clipping, accumulation, checkpoints, exact resume.

Step i reads rows [i*B, (i+1)*B) of the mix's packed sequences, so the data position is the step.
Checkpoints (every `checkpoint_every` steps, atomic) go to `work/checkpoints`; a run that finds one
there resumes from it and reproduces the uninterrupted loss curve exactly on CPU. Per step,
`metrics.jsonl` (and TensorBoard event files under `tensorboard/`) record: loss, cross-entropy,
load-balancing, router z and logit z losses, grad norm (total and per parameter group), learning
rate, tokens/s, achieved TFLOP/s and MFU (when the device's peak is configured or known), tokens per expert
per MoE layer, load imbalance (max/mean) and token drop rate. Loss spikes and grad-norm jumps out of
their recent band raise alarms (logged; optionally stopping the run).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from collections import deque
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from moeflow.configs import ModelConfig, TrainConfig
from moeflow.core import progress
from moeflow.core.progress import tqdm
from moeflow.moe import checkpoint, device, ladder, live, parallel
from moeflow.moe.data import Sequences
from moeflow.moe.metrics import Monitor, distributed_summary, group_grad_norms, group_of, rank_metrics
from moeflow.moe.model import Transformer, lm_loss
from moeflow.moe.optim import lr_at
from moeflow.tokenize.tokenizer import load as load_tokenizer

log = logging.getLogger(__name__)


class TrainingAlarm(RuntimeError):
    """A health alarm fired and the config asks to stop on alarms."""


class StopTraining(Exception):
    """Raised by `stop_after` to end a run between steps, as a kill would (tests use it)."""


def build_model(model_cfg: ModelConfig, vocab_size: int, seq_len: int, seed: int) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(model_cfg, vocab_size, seq_len)


def _sync(
    world: parallel.World, model: torch.nn.Module, clip: float, means: list[float]
) -> tuple[dict, float, list[float]]:
    """Under torchrun: reduce gradients, clip by the whole model's norm.

    Returns (group norms, norm, means of `means` over ranks).
    """
    world.reduce_gradients(model)
    squares = world.grad_square_sums(model, group_of)
    total = math.sqrt(sum(squares.values()))
    torch.nn.utils.clip_grads_with_norm_(
        [p for p in model.parameters() if p.grad is not None], clip, torch.tensor(total)
    )
    return {g: round(math.sqrt(v), 5) for g, v in sorted(squares.items())}, total, world.mean(means)


def _autocast(precision: str, device_type: str):
    if precision == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return nullcontext()


def _truncate_jsonl(path: Path, upto: int, world: parallel.World | None = None) -> list[dict]:
    """Keep the records of steps <= upto (a resumed run recomputes the rest); return them. Under torchrun
    every rank reads them (for identical alarm decisions) before rank 0 rewrites the file."""
    kept = (
        [r for r in map(json.loads, path.read_text().splitlines()) if r["step"] <= upto]
        if path.exists()
        else []
    )
    if world is not None:
        torch.distributed.barrier()
    if world is None or world.main:
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return kept


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
    from torch.utils.tensorboard import SummaryWriter

    dev = device.resolve(cfg.device)
    peak = cfg.peak_tflops or device.peak_tflops(dev, cfg.precision)
    world = parallel.init(cfg.distributed.expert_parallel, dev)
    main = world is None or world.main
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // (world.local_size if world else 1)))
    work = Path(work or out)
    work.mkdir(parents=True, exist_ok=True)
    data = Sequences(Path(mix_dir) / "train.arrow")
    needed = cfg.steps * cfg.batch_size
    if len(data) < needed:
        raise ValueError(
            f"train: the mix holds {len(data)} sequences, {needed} are needed (steps x batch_size)"
        )
    vocab = load_tokenizer(tokenizer_dir).get_vocab_size()
    max_len = max(data.max_len, cfg.seq_len)
    model = build_model(model_cfg, vocab, max_len, seed)
    if world is not None:
        world.shard(model)
    model.to(dev)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    params = model.num_params()
    micro = cfg.batch_size // cfg.grad_accum
    local = micro // (world.size if world else 1)  # each rank reads its slice of every micro-batch
    offset = world.rank * local if world else 0
    monitor = Monitor(cfg.alarms)
    band = ladder.Band(ladder_dir, cfg.steps, band_tolerance) if ladder_dir else None
    recent: deque[float] = deque(maxlen=ladder.SMOOTH)
    was_outside = False
    metrics_path = work / "metrics.jsonl"
    ckpt_root = work / "checkpoints"
    resumed_from = None
    start = 0
    latest = checkpoint.latest(ckpt_root)
    if latest is not None:
        state = checkpoint.load(latest, model, opt, world)
        start = resumed_from = state["step"]
        if main:
            log.warning("train: resuming from %s (step %d of %d)", latest, start, cfg.steps)
        for rec in _truncate_jsonl(metrics_path, start, world):
            monitor.check(rec["ce"], rec["grad_norm"])
            recent.append(rec["ce"])
        resumes = state.get("resumes", []) + [{"from_step": start}]
    else:
        if main:
            metrics_path.write_text("")
        resumes = []
    alarms_path = work / "alarms.jsonl"
    all_alarms = _truncate_jsonl(alarms_path, start, world)
    tb = SummaryWriter(str(work / "tensorboard"), purge_step=start + 1 if start else None) if main else None
    name = progress.task_name("train")  # `rung0` for a ladder rung
    table = live.LiveTable(name, cfg.steps, cfg.log_every, work / "tensorboard") if main else None
    with (
        open(metrics_path, "a") if main else open(os.devnull, "w") as log_f,
        tqdm(
            total=cfg.steps, initial=start, desc=name, unit="step", mininterval=5, disable=not main
        ) as bar,
    ):
        for step in range(start, cfg.steps):
            if stop_after is not None and step >= stop_after:
                raise StopTraining(f"stopped before step {step + 1}")
            t0 = time.perf_counter()
            lr = lr_at(step, cfg)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad(set_to_none=True)
            ce_sum = lb_sum = z_sum = lz_sum = 0.0
            per_expert = None
            dropped = 0
            first = step * cfg.batch_size
            seq_len = data.width(first, first + cfg.batch_size) - 1  # checks the step stays in one phase
            tokens_per_step = cfg.batch_size * seq_len
            for m in range(cfg.grad_accum):
                a = first + m * micro + offset
                rows = data.rows(a, a + local)
                with _autocast(cfg.precision, dev.type):
                    batch = device.batch(rows, dev)
                    ce, auxes, logit_z = lm_loss(model, batch, logit_z=cfg.logit_z_coef > 0)
                lb = (
                    torch.stack([a["load_balancing_loss"] for a in auxes]).mean()
                    if auxes
                    else ce.new_zeros(())
                )
                z = torch.stack([a["router_z_loss"] for a in auxes]).mean() if auxes else ce.new_zeros(())
                loss = ce + cfg.load_balance_coef * lb + cfg.router_z_coef * z + cfg.logit_z_coef * logit_z
                (loss / cfg.grad_accum).backward()
                ce_sum, lb_sum, z_sum, lz_sum = (
                    ce_sum + ce.item(),
                    lb_sum + lb.item(),
                    z_sum + z.item(),
                    lz_sum + logit_z.item(),
                )
                counts = [a["tokens_per_expert"] for a in auxes]
                per_expert = counts if per_expert is None else [a + b for a, b in zip(per_expert, counts)]
                dropped += sum(int(a["dropped"]) for a in auxes)
            if world is None:
                groups = group_grad_norms(model)
                grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
            else:
                groups, grad_norm, means = _sync(
                    world, model, cfg.grad_clip, [ce_sum, lb_sum, z_sum, lz_sum, dropped]
                )
                ce_sum, lb_sum, z_sum, lz_sum = means[:4]
                dropped = round(means[4] * world.size)
            opt.step()
            dt = time.perf_counter() - t0
            n = cfg.grad_accum
            ce_v = ce_sum / n
            per_expert_l = [c.tolist() for c in per_expert]
            imbalance = [max(c) / (sum(c) / len(c)) for c in per_expert_l]
            assignments = sum(sum(c) for c in per_expert_l)
            tflops = model.flops_per_token(seq_len) * tokens_per_step / dt / 1e12
            record = {
                "step": step + 1,
                "phase": int(data.phase[first]),
                "seq_len": seq_len,
                "loss": round(
                    ce_v
                    + cfg.load_balance_coef * lb_sum / n
                    + cfg.router_z_coef * z_sum / n
                    + cfg.logit_z_coef * lz_sum / n,
                    5,
                ),
                "ce": round(ce_v, 5),
                "load_balancing_loss": round(lb_sum / n, 5),
                "router_z_loss": round(z_sum / n, 5),
                "logit_z_loss": round(lz_sum / n, 5),
                "grad_norm": round(grad_norm, 5),
                "grad_norm_groups": groups,
                "lr": lr,
                "tokens_per_s": round(tokens_per_step / dt, 1),
                "tflops": round(tflops, 5),
                "mfu": round(tflops / peak, 5) if peak else None,
                "tokens_per_expert": per_expert_l,
                "load_imbalance": [round(x, 4) for x in imbalance],
                "token_drop_rate": round(dropped / assignments, 6) if assignments else 0.0,
            }
            if world is not None:
                record["ranks"] = rank_metrics(world, dt, len(per_expert_l))
            alarms = monitor.check(ce_v, grad_norm)
            recent.append(ce_v)
            if band is not None:
                record["ladder_band"] = band.at(step + 1)
                outside = (
                    band.check(step + 1, sum(recent) / len(recent)) if step >= cfg.warmup_steps else None
                )
                record["outside_ladder_band"] = outside is not None
                if (
                    outside and not was_outside
                ):  # alarm when the run leaves the band, not at every step outside
                    alarms.append(outside)
                was_outside = outside is not None
            for alarm in alarms:  # every rank sees the same values, so every rank decides the same
                all_alarms.append({"step": step + 1, "alarm": alarm})
                if main:
                    log.warning("train: step %d alarm %s", step + 1, alarm)
                    with open(alarms_path, "a") as f:
                        f.write(json.dumps(all_alarms[-1]) + "\n")
                if cfg.alarms.stop:
                    raise TrainingAlarm(f"step {step + 1}: {alarm}")
            log_f.write(json.dumps(record) + "\n")
            log_f.flush()
            if table is not None:
                table.step(record, alarms)
            if tb is not None:
                for key in (
                    "loss",
                    "ce",
                    "load_balancing_loss",
                    "router_z_loss",
                    "grad_norm",
                    "lr",
                    "tokens_per_s",
                    "token_drop_rate",
                ):
                    tb.add_scalar(f"train/{key}", record[key], step + 1)
                for i, x in enumerate(imbalance):
                    tb.add_scalar(f"moe/load_imbalance_layer{i}", x, step + 1)
            bar.update(1)
            if (step + 1) % cfg.log_every == 0:
                bar.set_postfix(loss=f"{ce_v:.3f}", gnorm=f"{grad_norm:.2f}")
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                checkpoint.save(
                    ckpt_root,
                    step + 1,
                    model,
                    opt,
                    {"data_position": (step + 1) * cfg.batch_size, "resumes": resumes},
                    cfg.keep_checkpoints,
                    world,
                )
    if not main:
        return None
    tb.close()
    summary = _finish(model, model_cfg, cfg, work, out, vocab, params, resumes, all_alarms, resumed_from,
                      max_len)
    return {**summary, "device": device.describe(dev), "peak_tflops": peak}


def _finish(
    model,
    model_cfg,
    cfg,
    work: Path,
    out: Path,
    vocab: int,
    params: dict,
    resumes: list,
    alarms: list,
    resumed_from,
    max_len: int,
) -> dict:
    """Copy the final checkpoint, metrics and event files into the artifact; summarise the run."""
    final = checkpoint.latest(work / "checkpoints")
    if work != out:
        shutil.copytree(final, out / "checkpoint")
        shutil.copy(work / "metrics.jsonl", out / "metrics.jsonl")
        shutil.copytree(work / "tensorboard", out / "tensorboard")
        shutil.copy(work / "alarms.jsonl", out / "alarms.jsonl")
    shutil.copy(final / "model.safetensors", out / "model.safetensors")
    (out / "model_config.json").write_text(
        json.dumps(
            {**model_cfg.model_dump(mode="json"), "vocab_size": vocab, "max_seq_len": max_len},
            indent=2,
            sort_keys=True,
        )
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["ce"] for r in records]
    k = min(10, len(losses))
    head, tail = float(np.mean(losses[:k])), float(np.mean(losses[-k:]))
    last = records[-1]
    tps = [r["tokens_per_s"] for r in records]
    step_tokens = [cfg.batch_size * r.get("seq_len", cfg.seq_len) for r in records]
    tokens = sum(step_tokens)
    flops = sum(
        model.flops_per_token(r.get("seq_len", cfg.seq_len)) * n for r, n in zip(records, step_tokens)
    )
    phases = [
        {"phase": r.get("phase", 0), "start_step": r["step"] - 1, "seq_len": r.get("seq_len", cfg.seq_len)}
        for i, r in enumerate(records)
        if i == 0 or r.get("phase") != records[i - 1].get("phase")
    ]
    return {
        "steps": cfg.steps,
        "tokens": tokens,
        "batch_size": cfg.batch_size,
        "phases": phases,
        "seq_len": max_len,
        "params_total": params["total"],
        "params_active": params["active"],
        "d_model": model_cfg.d_model,
        "n_layers": model_cfg.n_layers,
        "flops_per_token": model.flops_per_token(max_len),
        "flops": flops,
        "tail_loss": round(ladder.tail_loss(losses), 4),
        "initial_loss": round(head, 4),
        "final_loss": round(tail, 4),
        "loss_fell": tail < head,
        "tokens_per_s": round(float(np.median(tps)), 1),
        "tflops": round(float(np.median([r["tflops"] for r in records])), 5),
        "mfu": last["mfu"],
        "peak_grad_norm": max(r["grad_norm"] for r in records),
        "final_load_imbalance": last["load_imbalance"],
        "final_tokens_per_expert": last["tokens_per_expert"],
        "token_drop_rate": round(float(np.mean([r["token_drop_rate"] for r in records])), 6),
        "train_seconds": round(sum(n / r["tokens_per_s"] for r, n in zip(records, step_tokens)), 1),
        "steps_outside_ladder_band": sum(bool(r.get("outside_ladder_band")) for r in records),
        "vocab_size": vocab,
        "resumes": resumes,
        "resumed_from_step": resumed_from,
        "alarms": alarms,
        "schedule": cfg.schedule,
        "precision": cfg.precision,
        "distributed": distributed_summary(cfg, records),
    }
