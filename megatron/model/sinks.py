"""Attention sinks (--softmax-type, Megatron-Core's TransformerConfig.softmax_type).

A sink is one more logit per head that joins every query's softmax denominator and
attends to nothing (its value is zero): probs_j = exp(x_j) / (sum_i exp(x_i) + exp(s_h)).
`learnable` learns s_h per head (gpt-oss's `sinks`, Megatron-Core's `softmax_offset`);
`off-by-one` fixes s_h = 0 (softmax-one). The per-head logits live in CoreAttention as
`softmax_offset` [heads of this TP rank], split over TP with their heads.

Each attention path takes them here: the explicit softmax gets a sink column
(`sink_softmax`), SDPA gets an extra key whose value is zero and whose score is the
sink (`sdpa_with_sinks`, through its float mask), and the merged log-sum-exp of
context-parallel ring attention takes the sink once, after every key block
(`add_sinks_to_lse`, `sinks_grad`).
"""
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.mpu.layers import init_normal, set_parallel_attributes


def make_softmax_offset(softmax_type: str, heads: int, std: float, device, dtype):
    """The sink logits of `heads` heads: a learnable Parameter (normal init, split over TP
    on dim 0), zeros for off-by-one, None for vanilla."""
    if softmax_type == "vanilla":
        return None
    offset = torch.zeros(heads, device=device, dtype=dtype)
    if softmax_type == "off-by-one":
        return offset
    param = torch.nn.Parameter(offset)
    set_parallel_attributes(param, True, 0, 1, init_normal(std))
    return param


def _sink_column(sinks: torch.Tensor, shape, dtype) -> torch.Tensor:
    """sinks [h] as a score column [b, h, sq, 1] for scores of `shape` [b, h, sq, sk]."""
    b, h, sq, _ = shape
    return sinks.to(dtype).view(1, h, 1, 1).expand(b, h, sq, 1)


def sink_softmax(scores: torch.Tensor, hidden: Optional[torch.Tensor],
                 sinks: torch.Tensor) -> torch.Tensor:
    """softmax over [scores, sink] without the sink's column, in float32 at least: scores [b, h, sq,
    sk] (already scaled), hidden (True = a key the query may not see) broadcastable or None."""
    x = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
    if hidden is not None:
        x = x.masked_fill(hidden, float("-inf"))
    x = torch.cat([x, _sink_column(sinks, x.shape, x.dtype)], dim=-1)
    return torch.softmax(x, dim=-1)[..., :-1].to(scores.dtype)


def sdpa_with_sinks(q, k, v, hidden, sinks, dropout_p: float = 0.0, bias=None):
    """SDPA of q [b, h, sq, d] over k / v [b, h, sk, d] plus one sink key: its key and value
    are zero and its score is the head's sink, given through SDPA's float mask (hidden:
    True = not seen, broadcastable to [b, h, sq, sk]; bias: float scores added, or None)."""
    b, h, sq, d = q.shape
    sk = k.shape[2]
    zero = k.new_zeros(b, h, 1, d)
    k, v = torch.cat([k, zero], dim=2), torch.cat([v, zero], dim=2)
    scores = torch.zeros(1, 1, sq, sk, dtype=q.dtype, device=q.device)
    if bias is not None:
        scores = scores + bias.to(q.dtype)
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    scores = scores.expand(b, h, sq, sk)
    mask = torch.cat([scores, _sink_column(sinks, scores.shape, q.dtype)], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def add_sinks_to_lse(out, lse, sinks):
    """The result of attention over every key (out [b, h, s, d], float lse [b, h, s]) with the
    sinks joining the denominator: out scaled by exp(lse - lse'), lse' = log(e^lse + e^s)."""
    new_lse = torch.logaddexp(lse, sinks.float().view(1, -1, 1))
    return (out * torch.exp(lse - new_lse)[..., None]).to(out.dtype), new_lse


def sinks_grad(out, lse, dout, sinks):
    """d loss / d sinks [h] from the final (sink-included) out, lse and dout of these rows:
    -sum over rows of p_sink * (dout . out), p_sink = exp(s - lse)."""
    p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse)
    delta = (dout.float() * out.float()).sum(-1)
    return -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)
