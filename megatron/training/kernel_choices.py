"""The fused kernels' decisions a run's shapes imply, agreed by every rank at model build.

megatron/fused/choice.py answers each decision (op, dtype, shape bucket) by the mode of
`--fused-kernels-choice`; under torch.distributed an answer must be agreed by every rank at
one point of the program, and model build is that point: `build_model` runs on every rank,
in the same order, before any forward. `planned_decisions` lists what this rank's forwards
will ask (from the config: attention per sequence, micro batch and heads on this rank, in
training with attention dropout and in evaluation without, per sliding window, with sinks;
the norms over the rows on this rank; the head's exp_sum_ over this rank's vocabulary),
each only where our kernel applies to stand-ins of that shape; in bfloat16, where the kernel
has both, how it computes its products (oneDNN's microkernels or our dot products). A
decision not listed here (a shape the planner did not foresee) takes the op's rule on every
rank, without a timing.
"""
from __future__ import annotations

import torch

from megatron import fused
from megatron.fused import choice
from megatron.fused.attention import (attention_decision, bf16_brgemm, effective_window,
                                      products_decision)
from megatron.fused.elementwise import exp_sum_decision
from megatron.fused.norms import norm_decision


def _stand_in(shape, dtype) -> torch.Tensor:
    """A tensor of `shape` whose storage is one row (every outer index aliases it): enough
    for the checks of shape, dtype and layout that decide whether a kernel applies."""
    return torch.empty(shape[-1], dtype=dtype).as_strided(shape, (0,) * (len(shape) - 1) + (1,))


def attention_stand_in(config, dtype) -> torch.Tensor:
    """q of this rank's core attention in training, [seq, micro batch, heads, head size] (as
    a stand-in): seq / CP and heads / TP, or with all-to-all CP every position and heads / TP
    / CP. The memory planner asks its decision too (megatron/training/memory.py)."""
    m, p = config.model, config.parallel
    seq = m.seq_length // p.context_parallel_size
    heads = max(1, m.num_attention_heads // p.tensor_model_parallel_size)
    if p.context_parallel_size > 1 and p.cp_comm_type == "a2a":
        seq, heads = m.seq_length, max(1, heads // p.context_parallel_size)
    return _stand_in((seq, config.training.micro_batch_size, heads, m.kv_channels), dtype)


def _attention(config, dtype) -> list:
    m, p = config.model, config.parallel
    if m.attention_impl != "auto" or not m.masked_softmax_fusion:
        return []
    if p.context_parallel_size > 1 and p.cp_comm_type == "p2p":
        return []  # ring attention: its blocks always take our kernel where it applies
    if m.position_embedding_type == "alibi":
        return []  # no layer attends with a plain causal mask
    q = attention_stand_in(config, dtype)
    seq = q.shape[0]
    # the sliding windows (None: full attention) of the layers without attention chunks,
    # which our kernel takes as they are; chunked layers: folded into the batch, below
    windows = {effective_window(m.window_for_layer(n), seq) for n in range(1, m.num_layers + 1)
               if not (m.chunk_for_layer(n) or seq) < seq}
    stand_ins = [(q, window) for window in sorted(windows, key=lambda w: w or 0)]
    chunk = m.attention_chunk_size
    if chunk and q.shape[0] > chunk and q.shape[0] % chunk == 0:  # chunks folded into the batch
        stand_ins.append((_stand_in((chunk, q.shape[0] // chunk * q.shape[1], *q.shape[2:]),
                                    dtype), None))
    sinks = m.softmax_type != "vanilla"
    products, out = [], []
    for q, window in stand_ins:
        for dropout in dict.fromkeys((m.attention_dropout, 0.0)):
            if fused.causal_attention_fusable(q, q, q, dropout):
                out.append(attention_decision(q, dropout, window, sinks))
                if q.dtype == torch.bfloat16 and bf16_brgemm():
                    products.append(products_decision(q, dropout, window, sinks))
    # the bfloat16 kernel's products first: the timing of our kernel in attention's takes them
    return products + out


def _norms(config, dtype, seq: int) -> list:
    m, p = config.model, config.parallel
    if not m.layer_norm_fusion or m.normalization not in ("LayerNorm", "RMSNorm"):
        return []
    op = "layer_norm" if m.normalization == "LayerNorm" else "rms_norm"
    rows = seq * config.training.micro_batch_size
    if p.sequence_parallel:
        rows //= p.tensor_model_parallel_size
    shapes = [(rows, m.hidden_size)]
    if m.qk_layernorm:  # over each head of q and k
        heads = max(1, m.num_attention_heads // p.tensor_model_parallel_size)
        shapes.append((seq * config.training.micro_batch_size * heads, m.kv_channels))
    out = []
    for shape in shapes:
        x, w = _stand_in(shape, dtype), _stand_in(shape[-1:], dtype)
        if fused.layer_norm_fusable(x, w, w):
            out.append(norm_decision(op, x))
    return out


def _head(config, seq: int) -> list:
    m, p = config.model, config.parallel
    rows = seq * config.training.micro_batch_size
    vocab = m.padded_vocab_size // p.tensor_model_parallel_size
    dtype = torch.float32 if not m.fp16_lm_cross_entropy else _dtype(config)
    return [exp_sum_decision(_stand_in((rows, vocab), dtype))]


def _dtype(config) -> torch.dtype:
    t = config.training
    return torch.float16 if t.fp16 else torch.bfloat16 if t.bf16 else torch.float32


def planned_decisions(config) -> list:
    """The decisions this rank's training and evaluation forwards will ask on a CPU."""
    seq = config.model.seq_length // config.parallel.context_parallel_size
    dtype = _dtype(config)
    return _attention(config, dtype) + _norms(config, dtype, seq) + _head(config, seq)


def agree_kernel_choices(config, device) -> dict:
    """Set the mode of `--fused-kernels-choice` and agree this run's decisions across every
    rank (a collective over the world: call it on every rank, at the same point)."""
    choice.set_mode(config.model.fused_kernels_choice)
    decisions = planned_decisions(config) if torch.device(device).type == "cpu" else []
    return choice.agree(decisions)
