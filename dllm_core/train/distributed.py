"""Data-parallel drafter training with ``torch.distributed`` (launched by ``torchrun``).

Every rank builds the same global batch of a step (data draws depend only on seed and step), computes the
loss of its rows (one contiguous shard per rank, split again into ``grad_accum`` micro-batches), and
``DistributedDataParallel`` averages the gradients. Losses are normalised by the *global* batch's
denominator, so the summed gradient equals the one-process gradient of the same global batch and the loss
curve matches it to floating-point tolerance, whatever the number of processes or micro-batches. Rank 0
alone writes checkpoints and logs; a checkpoint written at one world size resumes at any other.

gloo on CPU, NCCL on CUDA (one GPU per rank, ``LOCAL_RANK``)::

    torchrun --nproc-per-node 2 -m dllm_core.cli train-dflash --target T --out D --batch-size 16
"""
from __future__ import annotations

import gc
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    """This process's place in the job (``rank`` of ``size``); ``World()`` is a single process."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def rows(self, n: int, micro: int = 0, accum: int = 1) -> slice:
        """The rows of a global batch of ``n`` that this rank computes in micro-batch ``micro`` of ``accum``."""
        parts = self.size * accum
        if n % parts:
            raise ValueError(f"--batch-size {n} must be divisible by processes x --grad-accum = {self.size} x "
                             f"{accum}")
        k = n // parts
        start = (self.rank * accum + micro) * k
        return slice(start, start + k)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def sum(self, value: float) -> float:
        """``value`` summed over ranks."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t[0])

    def gather(self, items: list) -> list:
        """Concatenation over ranks (rank order) of each rank's ``items``."""
        if self.size == 1:
            return items
        out: list = [None] * self.size
        dist.all_gather_object(out, items)
        return [x for part in out for x in part]

    def shard(self, n: int) -> slice:
        """This rank's contiguous share of ``n`` items (the first ranks take one more when uneven)."""
        k, r = divmod(n, self.size)
        start = self.rank * k + min(self.rank, r)
        return slice(start, start + k + (self.rank < r))


def init_world(device: str) -> tuple[World, str]:
    """The ``torchrun`` job this process belongs to (none: a single process) and the device it trains on.
    Starts the process group: gloo for ``cpu``, NCCL for ``cuda`` (device ``cuda:LOCAL_RANK``)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World(), device
    w = World(int(os.environ["RANK"]), size, int(os.environ.get("LOCAL_RANK", "0")))
    cuda = device.split(":")[0] == "cuda"
    if cuda:
        torch.cuda.set_device(w.local_rank)
        device = f"cuda:{w.local_rank}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return w, device


def wrap(module: torch.nn.Module, world: World) -> torch.nn.Module:
    """``module`` under ``DistributedDataParallel`` when there is more than one process."""
    if world.size == 1:
        return module
    from torch.nn.parallel import DistributedDataParallel

    ids = [torch.cuda.current_device()] if next(module.parameters()).is_cuda else None
    return DistributedDataParallel(module, device_ids=ids)


def no_sync(module: torch.nn.Module, last: bool):
    """Skip DDP's gradient all-reduce on every micro-batch but the last."""
    return module.no_sync() if hasattr(module, "no_sync") and not last else nullcontext()


def finish(world: World) -> None:
    """End of a run: every rank waits for rank 0's writes, then the process group goes. Call it after the
    DDP wrapper is released (``del``): the wrapper holds the group, which must not outlive its destruction."""
    if world.size > 1 and dist.is_initialized():
        gc.collect()  # DDP's reducer and any pending gloo work are freed while the group is still up
        dist.barrier()
        dist.destroy_process_group()


def is_worker() -> bool:
    """Whether this process is one of several ``torchrun`` workers."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1
