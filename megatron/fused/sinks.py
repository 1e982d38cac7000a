"""Attention sinks in the plain-PyTorch attention paths (megatron/model/sinks.py says what
sinks are): the explicit softmax with a sink column, and SDPA with one more key whose value
is zero and whose score is the sink. Here, below the model, so that auto's timing of our CPU
kernel with sinks (megatron/fused/attention.py) runs the path the model would take instead."""
from typing import Optional

import torch
import torch.nn.functional as F


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


def sdpa_with_sinks(q, k, v, hidden, sinks, dropout_p: float = 0.0, bias=None, scale=None):
    """SDPA of q [b, h, sq, d] over k / v [b, h, sk, d] plus one sink key: its key and value
    are zero and its score is the head's sink, given through SDPA's float mask (hidden:
    True = not seen, broadcastable to [b, h, sq, sk]; bias: float scores added, or None;
    scale: of q k^T, None: 1 / sqrt(d))."""
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
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          scale=scale)
