"""Training across processes started by torchrun: data parallel over all ranks, experts split across them.

Every rank builds the whole model from the same seed, then keeps only its experts (`World.shard`):
with W ranks and E experts, rank r holds experts [r*E/W, (r+1)*E/W). Each rank reads its own slice of
every micro-batch; a MoE layer routes its tokens, sends each (token, expert) assignment to the rank
that holds the expert with a ragged `all_to_all_single` (per-rank split sizes, nothing dropped), runs
its experts on what it received and sends the outputs back the same way. Gradients: non-expert
parameters are replicated, so their gradients are averaged over ranks (one flat all-reduce after
backward); an expert's gradient already sums every rank's tokens through the all-to-all's backward, so
it is divided by W. The load-balancing loss uses the global expert counts, so the sum over ranks
equals the single-process loss and its gradient. Checkpoints hold the whole model (rank 0 gathers the
experts), so they load into one process or into any rank count that divides the experts.

Legend: A assignments (token, expert) on this rank, D model width, E experts, W ranks.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from moeflow.moe.layer import MoE

EXPERT_KEY = ".experts."


def is_expert(name: str) -> bool:
    return EXPERT_KEY in f".{name}"


@dataclass
class World:
    rank: int
    size: int
    local_size: int
    expert_parallel: bool
    device: torch.device  # where collectives' tensors live (CUDA for NCCL)
    group: object = None
    all_to_all_s: float = 0.0  # seconds spent in the token all-to-all since the last `take_timer`
    received: list = field(
        default_factory=list
    )  # per MoE layer call: assignments this rank's experts processed

    @property
    def main(self) -> bool:
        return self.rank == 0

    def shard(self, model: nn.Module) -> None:
        """Give every MoE layer this world; with expert parallelism, keep this rank's experts only."""
        if self.expert_parallel:
            model.expert_shards = self.size
        for module in model.modules():
            if not hasattr(module, "experts"):
                continue
            if not isinstance(module, MoE):
                raise ValueError(
                    f"model.backend={model.cfg.backend!r} does not run under torchrun here: "
                    "use backend 'torch' for train.distributed"
                )
            module.world = self
            if self.expert_parallel:
                mlp = module.experts.mlp
                if mlp.num_experts % self.size:
                    raise ValueError(
                        f"model.num_experts={mlp.num_experts} cannot be split over {self.size} ranks: "
                        "choose a rank count that divides it, or set train.distributed.expert_parallel: false"
                    )
                for name in ("w1", "v1", "w2"):
                    w = getattr(mlp, name)
                    if w is not None:
                        setattr(mlp, name, nn.Parameter(self.local(w.detach())))
                mlp.num_experts //= self.size

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of an expert tensor stored for all experts ([E*F, D] or an optimizer moment)."""
        return full.chunk(self.size, dim=0)[self.rank].clone()

    def gather(self, part: torch.Tensor) -> torch.Tensor:
        """The whole expert tensor from every rank's rows (in rank order)."""
        parts = [torch.empty_like(part) for _ in range(self.size)]
        dist.all_gather(parts, part.contiguous())
        return torch.cat(parts)

    def sharded(self, name: str) -> bool:
        return self.expert_parallel and is_expert(name)

    def dispatch(self, x_AD: torch.Tensor, counts_E: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """Run assignments sorted by global expert id on the ranks holding those experts.

        Outputs come back in input order.
        """
        W = self.size
        send_WL = counts_E.view(W, -1)  # [destination rank, its local expert]
        recv_WL = torch.empty_like(send_WL)  # [source rank, my local expert]
        dist.all_to_all_single(recv_WL, send_WL.contiguous(), group=self.group)
        send, recv = send_WL.sum(1).tolist(), recv_WL.sum(1).tolist()
        x_RD = _AllToAll.apply(x_AD, recv, send, self)  # arrives ordered by (source rank, local expert)
        local_R = (
            torch.arange(send_WL.shape[1], device=x_AD.device).repeat(W).repeat_interleave(recv_WL.flatten())
        )
        order_R = local_R.argsort(stable=True)  # by local expert; within it, source rank then token order
        per_expert = recv_WL.sum(0)
        self.received.append(per_expert)
        y_RD = experts(x_RD[order_R], per_expert)[order_R.argsort()]
        return _AllToAll.apply(y_RD, send, recv, self)

    def global_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        total = counts_E.clone()
        dist.all_reduce(total, group=self.group)
        return total

    def take_timer(self) -> tuple[float, list]:
        seconds, received, self.all_to_all_s, self.received = self.all_to_all_s, self.received, 0.0, []
        return seconds, received

    def reduce_gradients(self, model: nn.Module) -> None:
        """Average replicated gradients over ranks (one flat all-reduce); scale expert gradients by 1/W."""
        shared = [p for n, p in model.named_parameters() if p.grad is not None and not self.sharded(n)]
        if shared:
            flat = torch.cat([p.grad.reshape(-1) for p in shared])
            dist.all_reduce(flat)
            flat /= self.size
            offset = 0
            for p in shared:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        for n, p in model.named_parameters():
            if p.grad is not None and self.sharded(n):
                p.grad /= self.size

    def grad_square_sums(self, model: nn.Module, group_of) -> dict[str, float]:
        """Per parameter group, the squared gradient norm of the whole model.

        Expert parts are summed over ranks.
        """
        names = sorted({group_of(n) for n, _ in model.named_parameters()})
        # column 0: replicated, column 1: sharded; summed on the device, read back once (no sync per parameter)
        sums = torch.zeros(len(names) * 2, dtype=torch.float64, device=self.device)
        cells, squares = [], []
        for n, p in model.named_parameters():
            if p.grad is not None:
                cells.append(2 * names.index(group_of(n)) + int(self.sharded(n)))
                squares.append(p.grad.detach().float().square().sum().double())
        if squares:
            sums.index_add_(0, torch.tensor(cells, device=self.device), torch.stack(squares).to(self.device))
        sums = sums.view(len(names), 2)
        sharded = sums[:, 1].clone()
        dist.all_reduce(sharded)
        local, shared = sums[:, 0].tolist(), sharded.tolist()
        return {g: local[i] + shared[i] for i, g in enumerate(names) if local[i] or shared[i]}

    def mean(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return (t / self.size).tolist()

    def gather_object(self, obj) -> list:
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out


class _AllToAll(torch.autograd.Function):
    """A timed, differentiable ragged all-to-all: the backward sends gradients back along the same splits."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], world: World
    ) -> torch.Tensor:
        ctx.splits, ctx.world = (out_splits, in_splits), world
        return _exchange(x, out_splits, in_splits, world)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _exchange(grad.contiguous(), in_splits, out_splits, ctx.world), None, None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], world: World) -> torch.Tensor:
    t0 = time.perf_counter()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=world.group)
    world.all_to_all_s += time.perf_counter() - t0
    return out


def init(expert_parallel: bool, device: torch.device) -> World | None:
    """The world torchrun started this process in (None when run as one process): NCCL when ranks
    compute on GPUs (each on its `LOCAL_RANK`'s, chosen by `device.resolve`), gloo on CPUs."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return None
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(minutes=10))
    group = dist.new_group(list(range(size)))
    return World(
        rank=dist.get_rank(),
        size=size,
        local_size=int(os.environ.get("LOCAL_WORLD_SIZE", size)),
        expert_parallel=expert_parallel,
        group=group,
        device=device,
    )
