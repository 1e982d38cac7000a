"""How each parameter is split over tensor-parallel ranks: the sharding metadata.

Every parameter carries a `sharding` dict (set where the layers build it) and
every checkpoint file stores {parameter name: dict} as "sharding". Fields:

- "dim": 0 | 1 | None (replicated): the dimension split over TP;
- "groups": the full tensor's `dim` holds this many equal groups, each split over
  TP, and a shard is [group 0 of rank r; group 1 of rank r; ...] (2 for the gated
  MLP's [gate; up] rows; 1 otherwise);
- fused QKV weights and biases also hold "query_groups" (G), "heads" and
  "head_dim": rows are G groups of [q heads of the group, k, v], each head_dim
  rows. With G % TP == 0 a shard is a contiguous block of groups; with
  TP % G == 0 rank r holds heads / TP query heads of group r // (TP / G) and a
  replica of that group's k and v (merging keeps the first replica).

`shard_tensor` and `merge_shards` are exact inverses for every layout; tools and
`--use-cpu-initialization` use them to go between the single-process tensor and
the shards.
"""
from typing import List, Optional, Sequence

import torch

REPLICATED = {"dim": None, "groups": 1}


def qkv_meta(query_groups: int, heads: int, head_dim: int) -> dict:
    return {"dim": 0, "groups": 1, "query_groups": query_groups, "heads": heads,
            "head_dim": head_dim}


def parameter_meta(param) -> dict:
    """The metadata of a parameter: its `sharding` attribute, else what the
    tensor-parallel attributes (`partition_dim`, `partition_stride`) say."""
    meta = getattr(param, "sharding", None)
    if meta is not None:
        return dict(meta)
    if not getattr(param, "tensor_model_parallel", False):
        return dict(REPLICATED)
    return {"dim": param.partition_dim, "groups": getattr(param, "partition_stride", 1)}


def _replicas(meta: dict, tp: int) -> int:
    """Ranks sharing one query group's k / v (1 unless TP > query groups)."""
    groups = meta.get("query_groups")
    return tp // groups if groups is not None and tp > groups else 1


def duplicated_tail(meta: dict, local_shape: Sequence[int], rank: int, tp: int) -> int:
    """Elements at the end of TP rank `rank`'s flattened shard that an earlier rank of
    its replica set also holds: the k / v rows of a query group when TP exceeds the
    groups (the first rank of each set owns them, as merge_shards keeps its copy); 0
    for every other parameter and for the first rank."""
    replicas = _replicas(meta, tp)
    if replicas == 1 or rank % replicas == 0:
        return 0
    per_row = 1
    for n in local_shape[1:]:
        per_row *= n
    return 2 * meta["head_dim"] * per_row


def check_shardable(shape: Sequence[int], meta: dict, tp: int) -> Optional[str]:
    """Why a full tensor of `shape` cannot be split over `tp` ranks, or None."""
    dim = meta.get("dim")
    if dim is None:
        return None
    if "query_groups" in meta:
        groups, heads = meta["query_groups"], meta["heads"]
        if (groups % tp and tp % groups) or heads % tp:
            return (f"{heads} heads in {groups} query groups cannot be split over TP {tp}: "
                    f"the groups must divide by TP or TP by the groups")
        return None
    parts = meta.get("groups", 1) * tp
    if shape[dim] % parts:
        return f"{shape[dim]} entries along dim {dim} do not split into {parts} equal parts"
    return None


def full_shape(local_shape: Sequence[int], meta: dict, tp: int) -> List[int]:
    """Shape of the single-process tensor whose shard has `local_shape`."""
    shape = list(local_shape)
    dim = meta.get("dim")
    if dim is None:
        return shape
    if "query_groups" in meta:
        shape[0] = (meta["heads"] + 2 * meta["query_groups"]) * meta["head_dim"]
    else:
        shape[dim] *= tp
    return shape


def _qkv_groups(full: torch.Tensor, meta: dict) -> torch.Tensor:
    groups, heads, head_dim = meta["query_groups"], meta["heads"], meta["head_dim"]
    return full.reshape(groups, heads // groups + 2, head_dim, *full.shape[1:])


def shard_tensor(full: torch.Tensor, meta: dict, rank: int, tp: int) -> torch.Tensor:
    """TP rank `rank`'s shard of the single-process tensor `full`."""
    dim = meta.get("dim")
    if dim is None or tp == 1:
        return full
    if "query_groups" in meta:
        view = _qkv_groups(full, meta)
        groups, replicas = meta["query_groups"], _replicas(meta, tp)
        if replicas == 1:
            per_rank = groups // tp
            return view[rank * per_rank:(rank + 1) * per_rank].reshape(-1, *full.shape[1:])
        group, part = divmod(rank, replicas)
        q_heads = (view.shape[1] - 2) // replicas
        q = view[group, part * q_heads:(part + 1) * q_heads]
        return torch.cat((q, view[group, -2:])).reshape(-1, *full.shape[1:])
    pieces = torch.chunk(full, meta.get("groups", 1) * tp, dim=dim)
    return torch.cat(pieces[rank::tp], dim=dim)


def merge_shards(shards: Sequence[torch.Tensor], meta: dict) -> torch.Tensor:
    """The single-process tensor from the shards of ranks 0 .. TP - 1 (inverse of shard_tensor)."""
    dim, tp = meta.get("dim"), len(shards)
    if dim is None or tp == 1:
        return shards[0]
    replicas = _replicas(meta, tp)
    if replicas > 1:
        head_dim, rest = meta["head_dim"], shards[0].shape[1:]
        views = [s.reshape(-1, head_dim, *rest) for s in shards]
        groups = []
        for first in range(0, tp, replicas):
            q = [v[:-2] for v in views[first:first + replicas]]
            groups.append(torch.cat(q + [views[first][-2:]]))
        return torch.cat(groups).reshape(-1, *rest)
    count = meta.get("groups", 1)
    split = [torch.chunk(s, count, dim=dim) for s in shards]
    return torch.cat([split[r][g] for g in range(count) for r in range(tp)], dim=dim)
