"""Context parallelism: the sequence split over CP ranks, and attention across them.

Split (`cp_chunk_indices`, `split_for_cp`): the sequence is cut into 2·CP equal
chunks and rank r holds chunks r and 2·CP − 1 − r, so every rank has the same
amount of causal work. `cp_positions` gives the global positions of the local tokens
(RoPE and learned positions follow them).

Ring attention (`--cp-comm-type p2p`, `RingAttention`): the keys / values of each
rank travel once around the CP ring (p2p to the next rank, from the previous one,
started before the local block is computed). Each query chunk attends to each key
chunk by their global chunk indices: earlier chunks fully, its own chunk causally,
later chunks not at all (blocks of equal lengths, the causal diagonal ones and the full
ones, go through the CPU flash-attention kernel, which returns the log-sum-exp and takes
the merged one back in its backward, where it applies). Partial results merge by their log-sum-exp. The backward
pass recomputes each block's probabilities from the saved log-sum-exp, and the
key / value gradients circulate with their keys and values, one more hop at the end
bringing them home.

All-to-all attention (`--cp-comm-type a2a`, DeepSpeed-Ulysses): an all-to-all turns
[local sequence, all heads] into [whole sequence, heads / CP], ordinary causal
attention runs on it (any attention path, sliding window included), and a second
all-to-all turns it back.
"""
import math
from typing import List

import torch
import torch.distributed as dist

from megatron import fused
from megatron.model.sinks import add_sinks_to_lse, sinks_grad
from megatron.mpu.mappings import group_rank, group_size

CP_COMM_TYPES = ("p2p", "a2a")


# -- the sequence split (pure) ------------------------------------------------------

def cp_chunk_indices(cp_rank: int, cp_size: int) -> List[int]:
    """The two global chunks (of 2·CP) that CP rank `cp_rank` holds."""
    return [cp_rank, 2 * cp_size - 1 - cp_rank]


def cp_token_index(seq_len: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Global positions of this rank's tokens, in local order [seq_len / CP]."""
    chunk = seq_len // (2 * cp_size)
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk)
                      for i in cp_chunk_indices(cp_rank, cp_size)])


def split_for_cp(tensor: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of `tensor` along the sequence dimension `dim`."""
    if cp_size == 1:
        return tensor
    index = cp_token_index(tensor.shape[dim], cp_rank, cp_size).to(tensor.device)
    return tensor.index_select(dim, index)


def split_batch_for_cp(batch, cp_rank: int, cp_size: int):
    """(tokens, labels, loss_mask, attention_mask, position_ids) [b, s] -> this rank's
    [b, s / CP] parts (the attention mask must be None: plain causal)."""
    tokens, labels, loss_mask, mask, position_ids = batch
    if cp_size == 1:
        return batch
    assert mask is None, "an attention mask cannot be split over CP ranks"
    return (*(split_for_cp(t, cp_rank, cp_size) for t in (tokens, labels, loss_mask)), None,
            split_for_cp(position_ids, cp_rank, cp_size))


def cp_positions(local_len: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Float positions [local_len] of the local tokens in the whole sequence."""
    return cp_token_index(local_len * cp_size, cp_rank, cp_size).to(
        device=device, dtype=torch.float32)


# -- block attention with log-sum-exp (plain PyTorch) -------------------------------

def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, groups, s, d] -> [b, heads, s, d]: each query head gets its group."""
    b, g, s, d = t.shape
    if g == heads:
        return t
    return t[:, :, None].expand(b, g, heads // g, s, d).reshape(b, heads, s, d)


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse of `_expand` for gradients: sum the heads of each group."""
    b, h, s, d = t.shape
    return t if h == groups else t.view(b, groups, h // groups, s, d).sum(2)


def _scores(q, k, scale, causal):
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))
    return s


def _kernel_layout(*tensors):
    """[b, h, s, d] -> [s, b, h, d] views, the CPU kernel's layout."""
    return [t.permute(2, 0, 1, 3) for t in tensors]


def _use_kernel(q, k, causal: bool, fusion: bool, v=None) -> bool:
    """The CPU flash-attention kernel (float32, head_dim % 16, sq == sk) for the causal
    diagonal blocks and the full (non-causal) ones; not for values of another head size
    (multi-latent attention), which the kernel does not take."""
    if not (fusion and q.shape == k.shape and (v is None or v.shape[-1] == q.shape[-1])):
        return False
    q_s, k_s = _kernel_layout(q, k)
    return fused.causal_attention_fusable(q_s, k_s, k_s, dtypes=(torch.float32,))


def _kernel_forward(q, k, v, scale, causal):
    b, h, s, _ = q.shape
    out, lse = fused.attention_with_lse(*_kernel_layout(q, k, v), scale, causal)
    return out.permute(1, 2, 0, 3), lse.view(b, h, s)


def _kernel_backward(q, k, v, out, lse, dout, scale, causal):
    b, h, s, _ = q.shape
    grads = fused.attention_with_lse_backward(
        *_kernel_layout(dout, q, k, v, out), lse.reshape(b * h, s), scale, causal)
    return [g.permute(1, 2, 0, 3) for g in grads]


def block_forward(q, k, v, scale: float, causal: bool, fusion: bool = True):
    """(out [b, h, sq, d], lse [b, h, sq]) of q over one key block (k / v grouped)."""
    if _use_kernel(q, _expand(k, q.shape[1]), causal, fusion, v):
        return _kernel_forward(q, _expand(k, q.shape[1]), _expand(v, q.shape[1]), scale, causal)
    s = _scores(q, _expand(k, q.shape[1]), scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse[..., None]).to(v.dtype), _expand(v, q.shape[1]))
    return out, lse


def block_backward(q, k, v, out, lse, dout, scale: float, causal: bool, fusion: bool = True):
    """(dq, dk, dv) of one block, from the final output and log-sum-exp of its rows."""
    heads, groups = q.shape[1], k.shape[1]
    ke, ve = _expand(k, heads), _expand(v, heads)
    if _use_kernel(q, ke, causal, fusion, v):
        dq, dk, dv = _kernel_backward(q, ke, ve, out, lse, dout, scale, causal)
        return dq, _fold(dk, groups), _fold(dv, groups)
    p = torch.exp(_scores(q, ke, scale, causal) - lse[..., None])
    delta = (dout.float() * out.float()).sum(-1, keepdim=True)
    dp = torch.matmul(dout, ve.transpose(-1, -2)).float()
    ds = (p * (dp - delta) * scale).to(q.dtype)
    dq = torch.matmul(ds, ke)
    dk = _fold(torch.matmul(ds.transpose(-1, -2), q), groups)
    dv = _fold(torch.matmul(p.to(dout.dtype).transpose(-1, -2), dout), groups)
    return dq, dk, dv


def merge(out, lse, block_out, block_lse):
    """Two partial softmax results of the same rows combined by their log-sum-exp."""
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new_lse)[..., None] + block_out * torch.exp(
        block_lse - new_lse)[..., None]
    return out.to(block_out.dtype), new_lse


def block_kind(q_chunk: int, k_chunk: int) -> str:
    """How a query chunk sees a key chunk under causal attention: full | causal | none."""
    return "full" if k_chunk < q_chunk else ("causal" if k_chunk == q_chunk else "none")


# -- tiles: the plain path holds TILE x TILE scores at a time -----------------------

TILE = 512


def _tile_pairs(q, k, causal: bool):
    """(query slice, key slice, causal) of the tiles of a block that attend at all."""
    q_tiles = [slice(i, min(i + TILE, q.shape[2])) for i in range(0, q.shape[2], TILE)]
    k_tiles = [slice(i, min(i + TILE, k.shape[2])) for i in range(0, k.shape[2], TILE)]
    for qi, qs in enumerate(q_tiles):
        for ki, ks in enumerate(k_tiles):
            kind = block_kind(qi, ki) if causal else "full"
            if kind != "none":
                yield qs, ks, kind == "causal"


def _whole_block(q, k, v, causal: bool, fusion: bool) -> bool:
    """The block runs in one piece: through the kernel (it tiles itself), or small."""
    small = q.shape[2] <= TILE and k.shape[2] <= TILE
    return small or _use_kernel(q, _expand(k, q.shape[1]), causal, fusion, v)


def tiled_forward(q, k, v, scale: float, causal: bool, fusion: bool = True):
    """`block_forward` tile by tile, merged by log-sum-exp (bounded scores memory)."""
    if _whole_block(q, k, v, causal, fusion):
        return block_forward(q, k, v, scale, causal, fusion)
    rows = {}
    for qs, ks, tile_causal in _tile_pairs(q, k, causal):
        part = block_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], scale, tile_causal, fusion)
        rows[qs.start] = merge(*rows.get(qs.start, (None, None)), *part)
    starts = sorted(rows)
    return (torch.cat([rows[i][0] for i in starts], dim=2),
            torch.cat([rows[i][1] for i in starts], dim=2))


def tiled_backward(q, k, v, out, lse, dout, scale: float, causal: bool, fusion: bool = True):
    """`block_backward` tile by tile."""
    if _whole_block(q, k, v, causal, fusion):
        return block_backward(q, k, v, out, lse, dout, scale, causal, fusion)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qs, ks, tile_causal in _tile_pairs(q, k, causal):
        g = block_backward(q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs], lse[:, :, qs],
                           dout[:, :, qs], scale, tile_causal, fusion)
        dq[:, :, qs] += g[0]
        dk[:, :, ks] += g[1]
        dv[:, :, ks] += g[2]
    return dq, dk, dv


# -- ring communication -------------------------------------------------------------

def _ring_exchange(tensors, group):
    """Start sending `tensors` to the next CP rank and receiving the previous rank's;
    returns (requests, received buffers)."""
    size, rank = group_size(group), group_rank(group)
    ranks = dist.get_process_group_ranks(group)
    nxt, prev = ranks[(rank + 1) % size], ranks[(rank - 1) % size]
    received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prev, group) for r in received]
    return dist.batch_isend_irecv(ops), received


def _wait(requests):
    for request in requests:
        request.wait()


def _chunks(t):
    """The two local chunks of t [b, h, 2c, d] along the sequence."""
    return t.chunk(2, dim=2)


def _ring_forward(q, k, v, scale, group, fusion=True):
    """Outputs and log-sum-exps of both local query chunks over every rank's keys."""
    size, rank = group_size(group), group_rank(group)
    q_ids = cp_chunk_indices(rank, size)
    results = [[None, None], [None, None]]
    for step in range(size):
        pending = _ring_exchange((k, v), group) if step < size - 1 else None
        k_ids = cp_chunk_indices((rank - step) % size, size)
        for qi, q_part in enumerate(_chunks(q)):
            for ki, (k_part, v_part) in enumerate(zip(_chunks(k), _chunks(v))):
                kind = block_kind(q_ids[qi], k_ids[ki])
                if kind != "none":
                    block = tiled_forward(q_part, k_part, v_part, scale, kind == "causal",
                                          fusion)
                    results[qi] = list(merge(*results[qi], *block))
        if pending:
            _wait(pending[0])
            k, v = pending[1]
    out = torch.cat([results[0][0], results[1][0]], dim=2)
    lse = torch.cat([results[0][1], results[1][1]], dim=2)
    return out, lse


def _ring_backward(q, k, v, out, lse, dout, scale, group, fusion=True):
    size, rank = group_size(group), group_rank(group)
    q_ids = cp_chunk_indices(rank, size)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    rows = list(zip(_chunks(q), _chunks(out), _chunks(lse[..., None]), _chunks(dout)))
    for step in range(size):
        pending = _ring_exchange((k, v), group) if step < size - 1 else None
        k_ids = cp_chunk_indices((rank - step) % size, size)
        dk_parts, dv_parts = _chunks(dk), _chunks(dv)
        for qi, (q_part, o_part, l_part, do_part) in enumerate(rows):
            for ki, (k_part, v_part) in enumerate(zip(_chunks(k), _chunks(v))):
                kind = block_kind(q_ids[qi], k_ids[ki])
                if kind == "none":
                    continue
                g = tiled_backward(q_part, k_part, v_part, o_part, l_part[..., 0], do_part,
                                   scale, kind == "causal", fusion)
                _chunks(dq)[qi].add_(g[0])
                dk_parts[ki].add_(g[1])
                dv_parts[ki].add_(g[2])
        if pending:
            _wait(pending[0])
            k, v = pending[1]
        grads = _ring_exchange((dk, dv), group)  # the gradients follow their keys
        _wait(grads[0])
        dk, dv = grads[1]
    return dq, dk, dv


class RingAttention(torch.autograd.Function):
    """Causal attention of load-balanced local chunks over the CP ring.

    q [b, heads, s_local, d], k / v [b, groups, s_local, d] -> out [b, heads, s_local, d].
    With sinks [heads] (megatron/model/sinks.py) they join the merged log-sum-exp once,
    after every block; the blocks' backward then takes the sink-included out and lse.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale, group, fusion, sinks=None):
        out, lse = _ring_forward(q, k, v, scale, group, fusion)
        if sinks is not None:
            out, lse = add_sinks_to_lse(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.scale, ctx.group, ctx.fusion = scale, group, fusion
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = _ring_backward(q, k, v, out, lse, dout, ctx.scale, ctx.group, ctx.fusion)
        dsinks = None if sinks is None else sinks_grad(out, lse, dout, sinks)
        return dq, dk, dv, None, None, None, dsinks


def ring_attention(q, k, v, group, scale=None, fusion: bool = True, sinks=None):
    """q [s_local, b, heads, d], k / v [s_local, b, groups, d] -> [s_local, b, heads * d];
    scores q k^T times `scale` (None: 1 / sqrt(d)). `fusion`: the CPU kernel for the
    diagonal blocks where it applies; sinks: the sink logits [heads] or None."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # views: saved as they are
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = RingAttention.apply(q, k, v, scale, group, fusion, sinks)
    b, h, s, d = out.shape
    return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


# -- all-to-all (Ulysses) -----------------------------------------------------------

def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split x along scatter_dim over the group, gather the pieces along gather_dim."""
    size = group_size(group)
    inputs = [t.contiguous() for t in x.chunk(size, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(size)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def _global_order(size: int) -> torch.Tensor:
    """Chunk permutation from rank order (r's two chunks, for r = 0..CP-1) to global order."""
    held = [i for r in range(size) for i in cp_chunk_indices(r, size)]
    return torch.tensor(sorted(range(2 * size), key=lambda j: held[j]))


def _reorder(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x [s, ...] in 2·CP chunks, permuted chunk-wise by `order`."""
    chunks = x.chunk(len(order), dim=0)
    return torch.cat([chunks[i] for i in order.tolist()], dim=0)


def a2a_attention(q, k, v, group, core_attention):
    """Ulysses: q / k / v [s_local, b, heads (groups), d] -> [s_local, b, heads * d] through
    `core_attention` over the whole sequence and heads / CP. Heads (and groups, else the
    caller expands k / v) divide by CP."""
    size = group_size(group)
    order = _global_order(size)
    inverse = torch.argsort(order)
    whole = [_reorder(_AllToAll.apply(t, group, 2, 0), order) for t in (q, k, v)]
    local = q.shape[2] // size  # the heads this rank attends with: its share of q's
    heads = slice(group_rank(group) * local, (group_rank(group) + 1) * local)
    context = core_attention(*whole, None, heads=heads)  # [s, b, heads / CP * d]
    s, b, _ = context.shape
    context = _reorder(context.view(s, b, q.shape[2] // size, -1), inverse)
    out = _AllToAll.apply(context, group, 0, 2)
    return out.reshape(out.shape[0], b, -1)
