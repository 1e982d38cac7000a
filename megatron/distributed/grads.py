"""Gradient reductions that are not data parallelism, and global-norm clipping.

- Tied embeddings: the first and last pipeline stages hold copies of the word
  embeddings; their gradients are summed over the embedding group (nothing to do
  for untied models).
- Sequence parallelism: replicated parameters that saw only a slice of the
  sequence (layer norms, row-parallel biases) have partial gradients, summed
  over the tensor-parallel group.
- The gradient norm counts each parameter once across TP and PP: sharded
  parameters on every rank, replicated ones on TP rank 0 only, and the last
  stage's embedding copy not at all. The k / v rows that TP ranks above the
  number of query groups share are counted on the first rank of each replica
  set only (megatron.mpu.sharding.duplicated_tail).
"""
import math
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.mpu.fsdp_shards import local
from megatron.mpu.mappings import all_reduce, group_rank, group_size
from megatron.mpu.sharding import duplicated_tail, parameter_meta


def grad_of(param: torch.nn.Parameter):
    return getattr(param, "main_grad", None) if hasattr(param, "main_grad") else param.grad


def _all_reduce_coalesced(grads: List[torch.Tensor], group) -> None:
    if not grads or group_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def tied_embedding_params(models, pstate) -> List[torch.nn.Parameter]:
    """This rank's copies of the word embeddings whose gradients are summed over the
    embedding group (the first stage's and the last stage's; none without pipelining or
    with untied embeddings, whose output layer is a parameter of its own, unless MTP
    embeds on the last stage: GPTModel.shared_embedding_weight)."""
    if pstate.pp_size == 1 or not pstate.in_embedding_group():
        return []
    params = []
    first, last = models[0], models[-1]
    if pstate.is_first_stage() and first.pre_process:
        params.append(first.shared_embedding_weight())
    if pstate.is_last_stage() and last.post_process and not last.pre_process:
        params.append(last.shared_embedding_weight())
    return [p for p in params if p is not None]


def allreduce_embedding_grads(models, pstate) -> None:
    """Sum the word-embedding gradients of the first and last pipeline stage."""
    # under FSDP the local shards: both stages shard the weight alike over their DP groups
    grads = [local(grad_of(p)) for p in tied_embedding_params(models, pstate)]
    _all_reduce_coalesced([g for g in grads if g is not None], pstate.embedding_group)


def allreduce_sequence_parallel_grads(models, tp_group) -> None:
    grads = [local(grad_of(p)) for m in models for p in m.parameters()
             if getattr(p, "sequence_parallel", False) and grad_of(p) is not None]
    _all_reduce_coalesced(grads, tp_group)


def counts_for_norm(param, tp_rank: int) -> bool:
    if getattr(param, "shared_embedding", False):
        return False
    return getattr(param, "tensor_model_parallel", False) or tp_rank == 0


def counted_parts(param, grad: torch.Tensor, tp_rank: int, tp: int,
                  start: int = 0) -> List[Tuple[torch.Tensor, bool, int]]:
    """`grad` (elements [start, start + numel) of the flattened `param`) as parts that
    the norm counts on this rank or not: (grad, counts_for_norm, start) for every parameter
    but the fused QKV of a rank that shares its k / v rows with an earlier rank, whose
    shared tail is cut off and not counted."""
    counted = counts_for_norm(param, tp_rank)
    tail = duplicated_tail(parameter_meta(param), param.shape, tp_rank, tp) if counted else 0
    if not tail:
        return [(grad, counted, start)]
    flat = grad.reshape(-1)
    cut = min(max(param.numel() - tail - start, 0), flat.numel())
    return [part for part in ((flat[:cut], True, start), (flat[cut:], False, start + cut))
            if part[0].numel()]


def expert_norm_groups(pstate) -> dict:
    """norm_and_nonfinite's expert arguments for a ParallelState."""
    return {"expert_mp_group": pstate.expert_mp_group, "etp_rank": pstate.etp_rank}


def norm_parts(params: List[torch.nn.Parameter], grads: List[torch.Tensor], tp_group,
               expert_mp_group=None, etp_rank: int = 0,
               starts: Optional[List[int]] = None) -> List[Tuple[torch.nn.Parameter,
                                                                torch.Tensor, bool, int]]:
    """(parameter, gradient part, counted, where the part begins in the flattened parameter)
    of every gradient given (None skipped), so that
    each distinct shard counts once over the model-parallel ranks (counted_parts). With
    `expert_mp_group` (ParallelState.expert_mp_group: ETP x EP x PP, set when EP > 1 or
    expert TP < TP) an expert parameter is split over expert TP only (no k / v replicas)
    and, replicated over expert TP, counts on expert-TP rank `etp_rank` 0. `starts`: where
    each gradient begins in its flattened parameter (0 by default)."""
    tp_rank, tp = group_rank(tp_group), group_size(tp_group)
    starts = starts if starts is not None else [0] * len(params)
    out = []
    for p, g, start in zip(params, grads, starts):
        if g is None:
            continue
        if expert_mp_group is not None and getattr(p, "expert_parallel", False):
            out.append((p, g, counts_for_norm(p, etp_rank), start))
        else:
            out.extend((p, *part) for part in counted_parts(p, g, tp_rank, tp, start))
    return out


def norm_and_nonfinite(params: List[torch.nn.Parameter], grads: List[torch.Tensor],
                       tp_group, mp_group, dp_group=None,
                       device: Optional[torch.device] = None, expert_mp_group=None,
                       edp_group=None, starts: Optional[List[int]] = None,
                       etp_rank: int = 0) -> Tuple[float, bool]:
    """(the global L2 norm, whether any gradient of any model-parallel rank holds an inf
    or a nan), from one multi-tensor norm and an all-reduce of two numbers per group, each
    shard counted once (norm_parts). With `dp_group` (the distributed optimizer's DP shards)
    the sums also run over DP, and those of expert parameters (`expert_parallel`) over
    `edp_group`. With `expert_mp_group` the expert sums run over it and the dense ones over
    `mp_group` (TP x PP). `device`: where the two numbers live when this rank holds no
    gradient. `starts`: where each gradient begins in its flattened parameter (the
    distributed optimizer's pieces)."""
    parts = norm_parts(params, grads, tp_group, expert_mp_group, etp_rank, starts)
    # Accumulated in float64 (see _float64_norms); finite gradients never overflow it.
    device = parts[0][1].device if parts else (device or torch.device("cpu"))
    # Expert sums take their own groups; whether they do is the same on every rank.
    own_group = expert_mp_group is not None
    split = own_group or (dp_group is not None and edp_group is not None)
    expert = [split and getattr(p, "expert_parallel", False) for p, *_ in parts]
    stats = _norm_stats([pq for pq, e in zip(parts, expert) if not e], device)
    if dp_group is not None:
        all_reduce(stats, dp_group)
    expert_stats = None
    if split:
        expert_stats = _norm_stats([pq for pq, e in zip(parts, expert) if e], device)
        if dp_group is not None:
            all_reduce(expert_stats, edp_group)
        if own_group:
            all_reduce(expert_stats, expert_mp_group)
        else:  # summed over mp_group with the dense ones
            stats, expert_stats = stats + expert_stats, None
    all_reduce(stats, mp_group)
    if expert_stats is not None:
        stats = stats + expert_stats
    square, nonfinite = stats.tolist()
    return math.sqrt(square), nonfinite > 0


def _norm_stats(parts, device) -> torch.Tensor:
    """[sum of counted squares, number of non-finite gradients] (float64) of norm_parts'
    (parameter, gradient, counted, start) parts."""
    if not parts:
        return torch.zeros(2, dtype=torch.float64, device=device)
    norms = _float64_norms([g for _, g, _, _ in parts], [start for *_, start in parts],
                           [_row_numel(p) for p, *_ in parts])
    counted = torch.tensor([keep for _, _, keep, _ in parts], device=device)
    return torch.stack([norms.masked_fill(~counted, 0.0).square().sum(),
                        (~torch.isfinite(norms)).sum().to(norms.dtype)])


_NORM_ROW = 2048
"""Elements per float32 partial norm on CPUs (short enough to be accurate to ~1e-7)."""


def _row_numel(param) -> int:
    """Elements of one dim-0 row of `param` (1 for a vector or a scalar)."""
    return math.prod(param.shape[1:]) if param.dim() > 1 else 1


def _square_sum(grad: torch.Tensor, start: int = 0, row: int = 0) -> torch.Tensor:
    """sum(grad ** 2) in float64, from float32 norms of segments of at most _NORM_ROW
    elements. When `grad` is whole dim-0 rows of its parameter (`row` elements each, from
    element `start` of the flattened parameter), the segments lie within those rows, where
    they lie in the whole parameter and in any dim-0 shard of it (FSDP's), so that a norm
    summed over shards equals the whole one to float64 rounding, and the clipping and the
    update they drive are the same bits (a vector's elements are squared in float64).
    Other pieces (the distributed optimizer's) are cut in _NORM_ROW rows from their start."""
    flat = grad.reshape(-1)
    if row and flat.numel() and start % row == 0 and flat.numel() % row == 0:
        if row == 1:
            return flat.double().square().sum()
        rows = flat.view(-1, row)
        width = min(row, _NORM_ROW)
        full = row - row % width
        total = torch.linalg.vector_norm(rows[:, :full].unflatten(1, (-1, width)),
                                         dim=2).double().square().sum()
        if full < row:
            total = total + torch.linalg.vector_norm(rows[:, full:], dim=1).double().square().sum()
        return total
    rows = flat.numel() // _NORM_ROW
    total = torch.zeros((), dtype=torch.float64, device=grad.device)
    if rows:
        norms = torch.linalg.vector_norm(flat[:rows * _NORM_ROW].view(rows, _NORM_ROW), dim=1)
        total = norms.double().square().sum()
    if flat.numel() > rows * _NORM_ROW:
        total = total + torch.linalg.vector_norm(flat[rows * _NORM_ROW:]).double().square()
    return total


def _float64_norms(grads: List[torch.Tensor], starts: Optional[List[int]] = None,
                   rows: Optional[List[int]] = None) -> torch.Tensor:
    """The L2 norm of each gradient, float64 [len(grads)]. On CPUs from float32 norms of
    short rows added in float64 (`_square_sum`): converting every gradient to float64
    first, as the multi-tensor norm does, costs a float64 copy of all of them, and one
    float32 sum over a large, mostly-zero gradient (the word embeddings') was off by 1e-4.
    `starts` / `rows`: where each gradient begins in its flattened parameter, and the
    parameter's dim-0 row size (_square_sum)."""
    if grads[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64))
    starts = starts or [0] * len(grads)
    rows = rows or [0] * len(grads)
    norms = torch.stack([_square_sum(g, s, r) for g, s, r in zip(grads, starts, rows)]).sqrt()
    for i in (~torch.isfinite(norms)).nonzero().flatten().tolist():
        # A float32 overflow (|g| > ~1e19) or a real inf / nan: recount in float64.
        norms[i] = torch.linalg.vector_norm(grads[i], dtype=torch.float64)
    return norms


def clip_coefficient(norm: float, max_norm: float) -> Optional[float]:
    """The factor that brings the gradients' norm down to `max_norm`; None when no clipping
    is needed (or --clip-grad is 0). As Megatron-Core's clip_grad_by_total_norm_fp32: the
    factor max_norm / (norm + 1e-6), applied whenever it is below 1."""
    if max_norm <= 0:
        return None
    coeff = max_norm / (norm + 1e-6)
    return coeff if coeff < 1.0 else None


def clip_grads(grads: List[torch.Tensor], norm: float, max_norm: float) -> None:
    coeff = clip_coefficient(norm, max_norm)
    if coeff is None:
        return
    for g in grads:
        if g is not None:
            g.mul_(coeff)
