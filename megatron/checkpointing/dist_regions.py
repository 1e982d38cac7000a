"""Where a rank's tensors sit in the global (single-process, layer-stacked) tensors.

A parameter's TP shard is one or more *blocks* along its split dimension, each a run of
rows (or columns) that is contiguous in the full tensor too (megatron/mpu/sharding.py):

- not split: one block, the whole tensor;
- split in `groups` equal groups (gated MLP: [gate; up]): one block per group;
- fused QKV with TP <= query groups: one block; with TP > query groups: the rank's query
  heads and its replica of the group's k and v (two blocks; replicas coincide and are
  stored once).

Expert parameters (sharding metadata "expert_dim", "num_experts") hold this EP rank's
E / EP consecutive experts along their expert axis, so their global offset there is
ep_rank x E / EP, and their split dimension is cut by the expert-TP rank and size.

A *region* is a box of a local tensor (the whole shard for the weights, a piece of the
flattened shard for the distributed optimizer) cut at block boundaries and mapped to
global offsets; layer tensors get the leading layer axis of Megatron-Core's stacked
layout. Regions become torch.distributed.checkpoint's ShardedTensor chunks.
"""
import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (ShardedTensorMetadata,
                                                               TensorProperties)

from megatron.mpu.sharding import full_shape

Block = Tuple[int, int, int]
"""(local start, length, global start) along the split dimension."""


@dataclass(frozen=True)
class Placement:
    """One parameter of this rank in the checkpoint."""

    key: str
    global_shape: Tuple[int, ...]
    """Full tensor shape, with the leading layer axis for layer parameters."""
    layer: Optional[int]
    dim: int
    blocks: Tuple[Block, ...]
    expert: Optional[Tuple[int, int]] = None
    """(expert axis of the local tensor, global index of its first expert) of expert
    parameters."""


def blocks_of(meta: dict, local_len: int, rank: int, tp: int) -> List[Block]:
    """The blocks of TP rank `rank`'s shard (`local_len` entries along the split dim)."""
    if meta.get("dim") is None or tp == 1:
        return [(0, local_len, 0)]
    if "query_groups" in meta:
        return _qkv_blocks(meta, local_len, rank, tp)
    groups = meta.get("groups", 1)
    part = local_len // groups
    return [(g * part, part, g * part * tp + rank * part) for g in range(groups)]


def _qkv_blocks(meta: dict, local_len: int, rank: int, tp: int) -> List[Block]:
    groups, heads, head_dim = meta["query_groups"], meta["heads"], meta["head_dim"]
    rows_per_group = (heads // groups + 2) * head_dim
    if groups % tp == 0:
        return [(0, local_len, rank * local_len)]
    replicas = tp // groups
    group, part = divmod(rank, replicas)
    q_rows = local_len - 2 * head_dim
    start = group * rows_per_group
    return [(0, q_rows, start + part * q_rows),
            (q_rows, 2 * head_dim, start + rows_per_group - 2 * head_dim)]


def placement(key: str, layer: Optional[int], num_layers: int, local_shape: Sequence[int],
              meta: dict, rank: int, tp: int, ep_rank: int = 0) -> Placement:
    """Where a local tensor of `local_shape` sits; `rank`, `tp` are the (expert-)TP rank and
    size that split it, `ep_rank` the EP rank of an expert parameter."""
    dim = meta.get("dim")
    dim = 0 if dim is None else dim
    shape = list(full_shape(local_shape, meta, tp)) if meta.get("dim") is not None \
        else list(local_shape)
    blocks = blocks_of(meta, local_shape[dim] if local_shape else 1, rank, tp)
    expert = None
    if meta.get("expert_dim") is not None:
        axis = meta["expert_dim"]
        shape[axis] = meta["num_experts"]
        expert = (axis, ep_rank * local_shape[axis])
    if layer is not None:
        shape = [num_layers] + shape
    return Placement(key, tuple(shape), layer, dim, tuple(blocks), expert)


def split_regions(place: Placement, view: torch.Tensor,
                  start: Sequence[int]) -> List[Tuple[torch.Tensor, Tuple[int, ...]]]:
    """(view, global offsets) of each piece of the local rectangle `view` at local offsets
    `start`, cut at the blocks."""
    if view.dim() == 0:
        return [(view, ())]
    dim, lo, n = place.dim, start[place.dim], view.shape[place.dim]
    pieces = []
    for block_start, length, global_start in place.blocks:
        a, b = max(lo, block_start), min(lo + n, block_start + length)
        if a >= b:
            continue
        piece = view.narrow(dim, a - lo, b - a)
        offsets = list(start)
        offsets[dim] = global_start + (a - block_start)
        if place.expert is not None:
            offsets[place.expert[0]] += place.expert[1]
        for part, at in _contiguous(piece, offsets):
            if place.layer is not None:
                part, at = part.unsqueeze(0), [place.layer] + at
            pieces.append((part, tuple(at)))
    return pieces


def _contiguous(view: torch.Tensor, offsets: List[int]) -> List[Tuple[torch.Tensor, List[int]]]:
    """`view` cut along its leading axes into contiguous parts (ShardedTensor chunks must
    be): a block of a stacked expert tensor's middle axis is one part per expert."""
    if view.is_contiguous():
        return [(view, offsets)]
    parts = []
    for i in range(view.shape[0]):
        for part, at in _contiguous(view[i], offsets[1:]):
            parts.append((part.unsqueeze(0), [offsets[0] + i] + at))
    return parts


def flat_rectangles(shape: Sequence[int], start: int, end: int) -> List[Tuple[int, Tuple, Tuple]]:
    """[start, end) of a flattened tensor of `shape` as boxes: (offset in the flat range,
    local offsets, sizes), in flat order (at most 2 x dims - 1): a partial slice of the
    first axis, whole slices, a partial slice, each partial one cut the same way."""
    if len(shape) <= 1:
        return [(0, (start,) if shape else (), (end - start,) if shape else ())]
    inner = 1
    for s in shape[1:]:
        inner *= s
    out, at = [], start

    def partial(index: int, lo: int, hi: int) -> None:
        for flat, offsets, sizes in flat_rectangles(shape[1:], lo, hi):
            out.append((index * inner + lo + flat - start, (index,) + offsets, (1,) + sizes))

    if at % inner:
        index, lo = divmod(at, inner)
        hi = min(inner, end - index * inner)
        partial(index, lo, hi)
        at = index * inner + hi
    whole = (end - at) // inner
    if whole:
        out.append((at - start, (at // inner,) + (0,) * (len(shape) - 1),
                    (whole,) + tuple(shape[1:])))
        at += whole * inner
    if at < end:
        partial(at // inner, 0, end - at)
    return out


def flat_piece_regions(place: Placement, local_shape: Sequence[int], flat: torch.Tensor,
                       start: int) -> List[Tuple[torch.Tensor, Tuple[int, ...]]]:
    """Regions of `flat`, which holds [start, start + numel) of the flattened local shard."""
    regions = []
    for at, offsets, sizes in flat_rectangles(local_shape, start, start + flat.numel()):
        numel = 1
        for s in sizes:
            numel *= s
        view = flat[at:at + numel].view(sizes)
        regions.extend(split_regions(place, view, offsets))
    return regions


def _complement(local: List[ShardMetadata], size: Sequence[int], rank: int, world: int):
    """Shard metadata covering what the local shards do not (placed on another rank): the
    cells of the grid cut at every local boundary. torch's ShardedTensor checks that the
    shards it is told of cover the tensor; DCP reads and writes the local ones only."""
    if not size:
        return []
    cuts = [sorted({0, n} | {m.shard_offsets[d] for m in local}
                   | {m.shard_offsets[d] + m.shard_sizes[d] for m in local})
            for d, n in enumerate(size)]
    covered = [(m.shard_offsets, m.shard_sizes) for m in local]
    other = f"rank:{(rank + 1) % world}/cpu"
    out = []
    for cell in itertools.product(*[list(zip(c[:-1], c[1:])) for c in cuts]):
        start = [a for a, _ in cell]
        if not any(all(o[d] <= start[d] < o[d] + z[d] for d in range(len(size)))
                   for o, z in covered):
            out.append(ShardMetadata(start, [b - a for a, b in cell], other))
    return out


def sharded_tensors(regions: Dict[str, List[Tuple[torch.Tensor, Tuple[int, ...]]]],
                    shapes: Dict[str, Tuple[int, ...]], rank: int,
                    world: int) -> Dict[str, ShardedTensor]:
    """One ShardedTensor per key from this rank's regions (no communication)."""
    out = {}
    for key, pieces in regions.items():
        shards = [Shard(t, ShardMetadata(list(off), list(t.shape), f"rank:{rank}/{t.device}"))
                  for t, off in pieces]
        props = TensorProperties(dtype=pieces[0][0].dtype)
        local = [s.metadata for s in shards]
        missing = _complement(local, shapes[key], rank, world) if world > 1 else []
        meta = ShardedTensorMetadata(local + missing, torch.Size(shapes[key]), props)
        out[key] = ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)
    return out
