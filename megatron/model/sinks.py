"""Attention sinks (--softmax-type, Megatron-Core's TransformerConfig.softmax_type).

A sink is one more logit per head that joins every query's softmax denominator and
attends to nothing (its value is zero): probs_j = exp(x_j) / (sum_i exp(x_i) + exp(s_h)).
`learnable` learns s_h per head (gpt-oss's `sinks`, Megatron-Core's `softmax_offset`);
`off-by-one` fixes s_h = 0 (softmax-one). The per-head logits live in CoreAttention as
`softmax_offset` [heads of this TP rank], split over TP with their heads.

Each attention path takes them: the explicit softmax gets a sink column
(`sink_softmax`), SDPA gets an extra key whose value is zero and whose score is the
sink (`sdpa_with_sinks`, through its float mask; both in megatron/fused/sinks.py, below the
model, where auto's timing of our kernel against them runs too), and the merged log-sum-exp of
context-parallel ring attention takes the sink once, after every key block
(`add_sinks_to_lse`, `sinks_grad`).
"""
import torch

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
