"""The few collectives a checkpoint needs, written so that they also run in one plain process
(no torch.distributed: a tool, a test, a one-rank run), where they are no-ops."""
import contextlib
from typing import Optional

import torch.distributed as dist

from megatron.checkpointing.io import CheckpointError


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


def all_gather(obj, group=None) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


@contextlib.contextmanager
def agreed(what: str, group=None):
    """A block that every rank of `group` runs (some with nothing to do) and that must not
    fail on some ranks only: they would go on to wait in a collective for the rank that
    left. When the block raises anywhere, every rank raises one CheckpointError with the
    same line (a CheckpointError's own, else "<what> failed on rank R: <type>: ...") and
    `agreed=True`, which entry points let rank 0 alone print. Collective."""
    problem = None
    try:
        yield
    except Exception as err:  # every failure is told to the peers, typed or not
        if not dist.is_initialized():
            raise
        line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        typed = isinstance(err, CheckpointError)
        problem = (typed, line if typed else
                   f"{what} failed on rank {rank()}: {type(err).__name__}: {line}")
    problems = [p for p in all_gather(problem, group) if p is not None]
    if problems:
        typed = [line for is_typed, line in problems if is_typed]
        raise CheckpointError((typed or [problems[0][1]])[0], agreed=True) from None


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
