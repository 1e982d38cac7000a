"""Row layouts shared by the architecture mappings (full, TP = 1 tensors).

Our fused QKV weight (and bias) rows come in G query groups, each
[its query heads; its key head; its value head] (G = heads: per-head [q, k, v]).
A gated MLP's first weight holds [gate; up] rows.
"""
from typing import Tuple

import torch


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped QKV rows from separate q [heads*d, ...], k and v [groups*d, ...]."""
    rest = q.shape[1:]
    parts = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest).contiguous()


def split_qkv(qkv: torch.Tensor, heads: int, groups: int, head_dim: int
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`: (q, k, v) with all heads' rows in head order."""
    rest = qkv.shape[1:]
    per_group = heads // groups * head_dim
    grouped = qkv.reshape(groups, per_group + 2 * head_dim, *rest)
    q, k, v = torch.split(grouped, [per_group, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` with rows of zeros appended up to `rows` (the padded vocabulary)."""
    extra = rows - tensor.shape[0]
    if extra == 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(extra, *tensor.shape[1:])])


def transposed(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous transpose (HF GPT-2's Conv1D weights are [in, out])."""
    return tensor.t().contiguous()
