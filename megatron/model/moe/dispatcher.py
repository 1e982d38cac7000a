"""Token dispatch over expert parallelism: tokens to the experts' ranks and back.

Both dispatchers take this rank's tokens x [T, h], probs and routing_map [T, E] and
return sum_k probs[t, e_k] x expert_{e_k}(x[t]) for every token, [T, h]:

- allgather: all-gather tokens, probs and map over EP; each rank runs its experts on
  the tokens routed to them and the partial outputs are reduce-scattered back.
- alltoall: each rank sends every (token, expert) pair to the expert's rank, in one
  all-to-all; the expert outputs come back by the reverse all-to-all and are weighted
  locally.

With --moe-apply-probs-on-input (Llama 4) each row is multiplied by its weight before the
expert and the outputs are summed unweighted.

Rank r of the EP group holds experts [r x E_local, (r + 1) x E_local).
"""
from typing import List, Tuple

import torch
import torch.distributed as dist

from megatron.config import moe as moe_config
from megatron.mpu.mappings import (all_to_all, gather_from_sequence_parallel_region, group_size,
                                   reduce_scatter_to_sequence_parallel_region)


def permute(x, routing_map) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[int]]:
    """(rows of x sorted by expert, their token ids, their expert ids, count per expert)."""
    expert, token = routing_map.t().nonzero(as_tuple=True)  # expert-major, tokens in order
    counts = routing_map.sum(dim=0).tolist()
    # index_select, not x[token]: its backward is one index_add instead of an accumulating
    # index_put (forward + backward 0.24-0.27 ms against 0.78-0.95 ms at 1024 x 256 rows)
    return x.index_select(0, token), token, expert, counts


def unpermute(y, token, weights, num_tokens: int):
    """sum over each token's rows of weight x row -> [num_tokens, h]."""
    out = y.new_zeros((num_tokens, y.shape[-1]))
    return out.index_add_(0, token, y * weights.unsqueeze(-1).to(y.dtype))


def weigh_inputs(rows, weights, experts):
    """(expert input rows, the weights of their outputs): with --moe-apply-probs-on-input the
    rows scaled by their weights and outputs of weight 1, else the rows as they are."""
    if not experts.cfg.moe.moe_apply_probs_on_input:
        return rows, weights
    return rows * weights.unsqueeze(-1).to(rows.dtype), torch.ones_like(weights)


def local_experts(x, probs, routing_map, experts):
    """The weighted output of the experts in `experts` (the columns of probs / map)."""
    rows, token, expert, counts = permute(x, routing_map)
    rows, weights = weigh_inputs(rows, probs[token, expert], experts)
    y = experts(rows, counts)
    return unpermute(y, token, weights, x.shape[0])


def _gather_map(routing_map, group):
    parts = [torch.empty_like(routing_map) for _ in range(group_size(group))]
    dist.all_gather(parts, routing_map.contiguous(), group=group)
    return torch.cat(parts)


def allgather_dispatch(x, probs, routing_map, experts, groups):
    if groups.ep_size == 1:
        return local_experts(x, probs, routing_map, experts)
    group, first = groups.ep_group, groups.ep_rank * experts.num_local
    cols = slice(first, first + experts.num_local)
    all_x = gather_from_sequence_parallel_region(x, group)
    all_probs = gather_from_sequence_parallel_region(probs, group)
    all_map = _gather_map(routing_map, group)
    out = local_experts(all_x, all_probs[:, cols], all_map[:, cols], experts)
    return reduce_scatter_to_sequence_parallel_region(out, group)


def _exchange_counts(counts: List[int], groups) -> torch.Tensor:
    """[EP, E_local]: how many rows each rank sends to each of our local experts."""
    send = torch.tensor(counts, dtype=torch.long).view(groups.ep_size, -1)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=groups.ep_group)
    return recv


def _regroup(rows, counts: torch.Tensor, by_expert: bool):
    """Rows in blocks (source rank, local expert) <-> blocks (local expert, source rank)."""
    ranks, local = counts.shape
    sizes = counts.flatten().tolist() if by_expert else counts.t().flatten().tolist()
    blocks = torch.split(rows, sizes)
    if by_expert:
        order = [r * local + e for e in range(local) for r in range(ranks)]
    else:
        order = [e * ranks + r for r in range(ranks) for e in range(local)]
    return torch.cat([blocks[i] for i in order]) if blocks else rows


def alltoall_dispatch(x, probs, routing_map, experts, groups):
    if groups.ep_size == 1:
        return local_experts(x, probs, routing_map, experts)
    rows, token, expert, counts = permute(x, routing_map)
    rows, weights = weigh_inputs(rows, probs[token, expert], experts)
    per_rank = torch.tensor(counts).view(groups.ep_size, -1)
    received = _exchange_counts(counts, groups)
    send, recv = per_rank.sum(1).tolist(), received.sum(1).tolist()
    inputs = _regroup(all_to_all(rows, groups.ep_group, send, recv), received, by_expert=True)
    outputs = experts(inputs, received.sum(0).tolist())
    back = all_to_all(_regroup(outputs, received, by_expert=False), groups.ep_group, recv, send)
    return unpermute(back, token, weights, x.shape[0])


DISPATCHERS = {name: globals()[f"{name}_dispatch"] for name in moe_config.DISPATCHERS}
"""--moe-token-dispatcher-type's function by name: each of config/moe.py's DISPATCHERS is
`<name>_dispatch` here (adding one: its name there, its function here)."""
