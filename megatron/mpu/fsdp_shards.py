"""The local shards of FSDP2's parameters (DTensors split along dim 0 over the data-parallel
group, torch.chunk's split: ceil(rows / DP) rows per rank, the last ranks' shards shorter or
empty), as plain tensors and their offsets in the TP-local whole. Every helper leaves a
plain tensor as it is, so code that knows nothing of FSDP takes both."""
from typing import Tuple

import torch
from torch.distributed.tensor import DTensor


def is_sharded(tensor) -> bool:
    return isinstance(tensor, DTensor)


def local(tensor):
    """The local shard of a DTensor (a view); any other tensor (or None) as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_row_offset(tensor) -> int:
    """The first dim-0 row of this rank's shard of a DTensor (0 for a plain tensor)."""
    if not isinstance(tensor, DTensor):
        return 0
    mesh = tensor.device_mesh
    rows = tensor.shape[0]
    per_rank = -(-rows // mesh.size())
    return min(mesh.get_local_rank() * per_rank, rows)


def shard_offsets(tensor) -> Tuple[int, ...]:
    """Where the local shard starts in the whole, per dimension."""
    if tensor.dim() == 0:
        return ()
    return (shard_row_offset(tensor),) + (0,) * (tensor.dim() - 1)


def shard_start(tensor) -> int:
    """Where the local shard begins in the flattened whole (row offset times row size)."""
    row = 1
    for size in tensor.shape[1:]:
        row *= size
    return shard_row_offset(tensor) * row


def local_shape(tensor) -> Tuple[int, ...]:
    return tuple(local(tensor).shape)


def like(value: torch.Tensor, param):
    """`value` (this rank's shard of a tensor shaped as `param`) as a DTensor placed as
    `param` is, so that optimizer state matches its sharded parameter; `value` itself when
    `param` is a plain tensor."""
    if not isinstance(param, DTensor):
        return value
    return DTensor.from_local(value.view(local_shape(param)), param.device_mesh,
                              param.placements, shape=param.shape, stride=param.stride())
