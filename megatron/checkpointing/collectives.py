"""The few collectives a checkpoint needs, written so that they also run in one plain process
(no torch.distributed: a tool, a test, a one-rank run), where they are no-ops."""
import contextlib
from typing import Optional

import torch.distributed as dist


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def gather(obj, group=None) -> Optional[list]:
    """Every rank's `obj` on rank 0 (None elsewhere)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * world() if rank() == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


def all_gather(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * world()
    dist.all_gather_object(out, obj)
    return out


@contextlib.contextmanager
def process_group():
    """A one-rank gloo group for the block when torch.distributed is not started (a plain
    single process: DCP's ShardedTensors need a default group)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
