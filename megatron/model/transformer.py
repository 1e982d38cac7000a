"""Pre-layer-norm transformer built from tensor-parallel layers.

Activations are [s, b, h] (sequence first, as Megatron), or [s / TP, b, h]
between tensor-parallel regions under sequence parallelism.
"""
import contextlib
import math

import torch
import torch.nn.functional as F

from megatron.config import ModelConfig
from megatron.model import fused
from megatron.mpu import checkpoint, get_rng_tracker
from megatron.mpu.layers import (ColumnParallelLinear, RowParallelLinear, divide, init_normal,
                                 layer_norm_init_attributes, scaled_init_normal)
from megatron.mpu.mappings import group_size


def make_layer_norm(cfg: ModelConfig, device, dtype):
    norm = fused.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, fusion=cfg.layer_norm_fusion,
                           sequence_parallel=cfg.sequence_parallel)
    layer_norm_init_attributes(norm)
    return norm.to(device=device, dtype=dtype)


def dropout_rng_context(sequence_parallel: bool):
    """Activations split across TP ranks need per-rank dropout masks."""
    return get_rng_tracker().fork() if sequence_parallel else contextlib.nullcontext()


class CoreAttention(torch.nn.Module):
    """softmax(q k^T / sqrt(d)) v over this rank's heads, causal or with a mask."""

    def __init__(self, cfg: ModelConfig, layer_number: int):
        super().__init__()
        self.cfg = cfg
        self.layer_number = max(1, layer_number)
        self.dropout_p = cfg.attention_dropout

    def forward(self, q, k, v, mask):
        # q, k, v: [s, b, np, hn] -> [b, np, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        if self._use_sdpa(mask, q):
            context = self._sdpa(q, k, v, mask)
        else:
            context = self._explicit(q, k, v, mask)
        b, n, s, d = context.shape
        return context.permute(2, 0, 1, 3).reshape(s, b, n * d)

    def _use_sdpa(self, mask, q):
        """auto: SDPA for plain causal attention, except where our path is faster or
        needed: explicit masks, fp16 layer scaling, and dropout on CPUs (SDPA then
        falls back to unfused math with slow Bernoulli sampling)."""
        impl = self.cfg.attention_impl
        if impl == "sdpa":
            return True
        if impl == "auto":
            cpu_dropout = self.training and self.dropout_p > 0 and q.device.type == "cpu"
            scaled_fp16 = q.dtype == torch.float16 and self.cfg.apply_query_key_layer_scaling
            return mask is None and not (cpu_dropout or scaled_fp16)
        return False

    def _sdpa(self, q, k, v, mask):
        p = self.dropout_p if self.training else 0.0
        attn_mask = None if mask is None else ~mask
        with get_rng_tracker().fork() if p > 0 else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p,
                                                  is_causal=mask is None)

    def _explicit(self, q, k, v, mask):
        coeff = self.layer_number if self.cfg.apply_query_key_layer_scaling else 1.0
        norm = math.sqrt(q.shape[-1]) * coeff
        scores = torch.matmul(q, k.transpose(-1, -2)) / norm
        probs = fused.attention_softmax(
            scores, scale=coeff, causal=mask is None, mask=mask,
            softmax_in_fp32=self.cfg.attention_softmax_in_fp32 or coeff != 1.0,
            fusion=self._fusion())
        if self.training and self.dropout_p > 0:
            with get_rng_tracker().fork():
                probs = fused.dropout(probs, self.dropout_p, True, fusion=self._fusion())
        return torch.matmul(probs, v)

    def _fusion(self) -> bool:
        return self.cfg.masked_softmax_fusion and self.cfg.attention_impl != "torch"


class ParallelAttention(torch.nn.Module):
    """Self-attention with heads split over TP: fused QKV (column) then output (row).

    The QKV weight rows are ordered [head, (q, k, v), head_dim], so a TP shard is
    a contiguous block of whole heads and shards merge by concatenation.
    """

    def __init__(self, cfg: ModelConfig, layer_number: int, tp_group, device, dtype):
        super().__init__()
        self.cfg = cfg
        tp = group_size(tp_group)
        self.heads_per_partition = divide(cfg.num_attention_heads, tp)
        common = dict(tp_group=tp_group, sequence_parallel=cfg.sequence_parallel,
                      device=device, dtype=dtype)
        self.query_key_value = ColumnParallelLinear(
            cfg.hidden_size, 3 * cfg.hidden_size, init_method=init_normal(cfg.init_method_std), **common)
        self.core_attention = CoreAttention(cfg, layer_number)
        self.dense = RowParallelLinear(
            cfg.hidden_size, cfg.hidden_size, input_is_parallel=True, skip_bias_add=True,
            init_method=scaled_init_normal(cfg.init_method_std, cfg.num_layers), **common)

    def forward(self, hidden, mask):
        qkv = self.query_key_value(hidden)
        s, b, _ = qkv.shape
        qkv = qkv.view(s, b, self.heads_per_partition, 3 * self.cfg.kv_channels)
        q, k, v = qkv.chunk(3, dim=-1)
        if self.cfg.recompute_granularity == "selective":
            context = checkpoint(self.core_attention, q, k, v, mask)
        else:
            context = self.core_attention(q, k, v, mask)
        return self.dense(context)


class ParallelMLP(torch.nn.Module):
    """h -> ffn (column parallel) -> GeLU -> h (row parallel)."""

    def __init__(self, cfg: ModelConfig, tp_group, device, dtype):
        super().__init__()
        self.cfg = cfg
        common = dict(tp_group=tp_group, sequence_parallel=cfg.sequence_parallel, skip_bias_add=True,
                      device=device, dtype=dtype)
        self.dense_h_to_4h = ColumnParallelLinear(
            cfg.hidden_size, cfg.ffn_hidden_size, init_method=init_normal(cfg.init_method_std), **common)
        self.dense_4h_to_h = RowParallelLinear(
            cfg.ffn_hidden_size, cfg.hidden_size, input_is_parallel=True,
            init_method=scaled_init_normal(cfg.init_method_std, cfg.num_layers), **common)

    def forward(self, hidden):
        x, bias = self.dense_h_to_4h(hidden)
        x = fused.bias_gelu(bias, x, fusion=self.cfg.bias_gelu_fusion)
        return self.dense_4h_to_h(x)


class ParallelTransformerLayer(torch.nn.Module):
    """x + Attn(LN(x)), then + MLP(LN(.)); dropout on each branch output."""

    def __init__(self, cfg: ModelConfig, layer_number: int, tp_group, device, dtype):
        super().__init__()
        self.cfg = cfg
        self.layer_number = layer_number
        self.input_layernorm = make_layer_norm(cfg, device, dtype)
        self.self_attention = ParallelAttention(cfg, layer_number, tp_group, device, dtype)
        self.post_attention_layernorm = make_layer_norm(cfg, device, dtype)
        self.mlp = ParallelMLP(cfg, tp_group, device, dtype)

    def _residual(self, out_and_bias, residual):
        out, bias = out_and_bias
        with dropout_rng_context(self.cfg.sequence_parallel):
            return fused.bias_dropout_add(out, bias, residual, self.cfg.hidden_dropout,
                                          self.training, fusion=self.cfg.bias_dropout_fusion)

    def forward(self, hidden, mask=None):
        hidden = self._residual(self.self_attention(self.input_layernorm(hidden), mask), hidden)
        return self._residual(self.mlp(self.post_attention_layernorm(hidden)), hidden)


class ParallelTransformer(torch.nn.Module):
    """The layers of one pipeline chunk, plus the final layer norm on the last one.

    `layer_offset` is the global index of the first local layer; layers are named
    by their local index (as in Megatron's checkpoints) but know their global number.
    """

    def __init__(self, cfg: ModelConfig, tp_group, layer_offset: int, num_local_layers: int,
                 post_process: bool, device=None, dtype=torch.float32):
        super().__init__()
        self.cfg = cfg
        self.layer_offset = layer_offset
        self.layers = torch.nn.ModuleList(
            ParallelTransformerLayer(cfg, layer_offset + i + 1, tp_group, device, dtype)
            for i in range(num_local_layers))
        self.final_layernorm = make_layer_norm(cfg, device, dtype) if post_process else None

    def _run(self, start, end):
        def run(hidden, mask):
            for layer in self.layers[start:end]:
                hidden = layer(hidden, mask)
            return hidden
        return run

    def forward(self, hidden, mask=None):
        if self.cfg.recompute_granularity == "full" and self.training:
            n = self.cfg.checkpoint_num_layers
            if self.cfg.recompute_method == "block":  # recompute the first n layers only
                for i in range(len(self.layers)):
                    run = self._run(i, i + 1)
                    hidden = checkpoint(run, hidden, mask) if i < n else run(hidden, mask)
            else:  # uniform: every chunk of n layers
                for start in range(0, len(self.layers), n):
                    hidden = checkpoint(self._run(start, start + n), hidden, mask)
        else:
            hidden = self._run(0, len(self.layers))(hidden, mask)
        if self.final_layernorm is not None:
            hidden = self.final_layernorm(hidden)
        return hidden
