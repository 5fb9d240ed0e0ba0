"""Where training computes: the device a run asks for (auto: CUDA when present), its name, count and peak.

`train.device` picks it; model, optimizer state, batches, evaluation and ladder rungs go there. Under
torchrun each rank takes the GPU of its `LOCAL_RANK`. The peak FLOP/s of a few known GPUs (dense bf16,
from their vendors' data sheets) gives an MFU when `train.peak_tflops` is unset.
"""

from __future__ import annotations

import os
import platform

import torch

# dense bf16 tensor-core peak, TFLOP/s, by a substring of torch.cuda.get_device_name()
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


class DeviceError(RuntimeError):
    """The configured device is not available on this machine."""


def resolve(requested: str = "auto") -> torch.device:
    """`auto`, `cpu` or `cuda` as a torch device; `cuda` selects this rank's GPU (`LOCAL_RANK`)."""
    if requested == "cpu" or requested == "auto" and not torch.cuda.is_available():
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError("train.device is 'cuda' but torch sees no CUDA device on this machine "
                          f"(torch {torch.__version__}); set train.device: auto or cpu")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def describe(device: torch.device) -> dict:
    """What the card states: the device type, its name and how many this machine has."""
    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device),
                "count": torch.cuda.device_count()}
    return {"type": "cpu", "name": platform.processor() or platform.machine(), "count": os.cpu_count()}


def peak_tflops(device: torch.device, precision: str) -> float | None:
    """The known dense peak for bf16 on a known GPU, else None (MFU is then not reported)."""
    if device.type != "cuda" or precision != "bf16":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def batch(rows, device: torch.device) -> torch.Tensor:
    """A numpy batch as a tensor on `device` (pinned and copied without blocking when it is a GPU)."""
    t = torch.from_numpy(rows)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
