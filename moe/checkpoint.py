"""Training checkpoints: model and optimizer tensors in safetensors, the rest in JSON.

The JSON holds the step, the schedule, the RNG state and the data position.

A checkpoint is a folder `step-NNNNNNN/` written under a temporary name, fsynced and renamed, so a
kill during a write leaves the previous checkpoint intact and the half-written one is never read.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moeflow.moe import parallel

STATE = "trainer_state.json"


def _fsync_tree(folder: Path) -> None:
    for p in folder.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())


def _param_names(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[int, str]:
    """The optimizer state's parameter index -> the parameter's name."""
    names = {id(p): n for n, p in model.named_parameters()}
    ids = [i for g in opt.state_dict()["param_groups"] for i in g["params"]]
    return dict(zip(ids, (names[id(p)] for g in opt.param_groups for p in g["params"])))


def save(
    root: Path,
    step: int,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    state: dict,
    keep: int,
    world: parallel.World | None = None,
) -> Path | None:
    """Write a checkpoint of the whole model.

    Under torchrun every rank calls it (experts are gathered), rank 0 writes.
    """
    model_state = {k: v.detach() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    names = _param_names(model, opt)
    if world is not None:
        model_state = {k: world.gather(v) if world.sharded(k) else v for k, v in model_state.items()}
        opt_state["state"] = {
            idx: {
                k: world.gather(v) if world.sharded(names[idx]) and torch.is_tensor(v) and v.dim() else v
                for k, v in per.items()
            }
            for idx, per in opt_state["state"].items()
        }
        if not world.main:
            return None
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step-{step:07d}", root / f".step-{step:07d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.contiguous() for k, v in model_state.items()}, str(tmp / "model.safetensors"))
    tensors, scalars = {}, {}
    for idx, per_param in opt_state["state"].items():
        for name, value in per_param.items():
            if torch.is_tensor(value):
                tensors[f"{idx}.{name}"] = value.detach().reshape(value.shape or (1,)).contiguous()
                scalars[f"{idx}.{name}"] = list(value.shape)
            else:
                scalars[f"{idx}.{name}"] = value
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():  # this rank's GPU generator (router jitter draws on it there)
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    meta = {"step": step, "param_groups": opt_state["param_groups"], "optimizer_entries": scalars, **state}
    (tmp / STATE).write_text(json.dumps(meta, indent=2, sort_keys=True))
    _fsync_tree(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(root: Path) -> Path | None:
    done = sorted(p for p in Path(root).glob("step-*") if (p / STATE).exists())
    return done[-1] if done else None


def load(
    folder: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, world: parallel.World | None = None
) -> dict:
    """Restore model, optimizer and the torch RNG; return the trainer state (step, data position, ...).
    Under torchrun each rank keeps its own experts' rows of the whole checkpoint."""
    meta = json.loads((folder / STATE).read_text())
    model_state = load_file(str(folder / "model.safetensors"))
    if world is not None:
        model_state = {k: world.local(v) if world.sharded(k) else v for k, v in model_state.items()}
    model.load_state_dict(model_state, strict=True)
    tensors = load_file(str(folder / "optimizer.safetensors"))
    names = _param_names(model, opt)
    state: dict = {}
    for key, entry in meta["optimizer_entries"].items():
        idx, name = key.split(".", 1)
        value = tensors[key].reshape(entry) if isinstance(entry, list) else entry
        if world is not None and world.sharded(names[int(idx)]) and torch.is_tensor(value) and value.dim():
            value = world.local(value)
        state.setdefault(int(idx), {})[name] = value
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    return meta
