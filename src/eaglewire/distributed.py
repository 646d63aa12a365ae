"""Process-group setup for runs under ``torchrun`` (gloo on CPU, nccl on CUDA)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int
    size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


def init_world() -> World:
    """Join the process group torchrun describes in the environment; a plain run is a world of one."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World(0, 1)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return World(dist.get_rank(), dist.get_world_size())
