"""Self-attention over tensor-parallel heads: the core softmax(q k^T) v with its paths
(our CPU kernel, SDPA, the explicit softmax; sliding windows and attention sinks) and the
fused-QKV ParallelAttention around it (megatron/model/mla.py builds multi-latent attention
on both). Activations are [s, b, h] (sequence first, as Megatron).
"""
import contextlib
import math

import torch
import torch.nn.functional as F

from megatron.config import ModelConfig
from megatron import fused
from megatron.model import context_parallel as cp
from megatron.model.positions import AlibiBias, RotaryEmbedding, apply_rotary
from megatron.fused.attention import effective_window, future_keys, outside_window
from megatron.fused.sinks import sdpa_with_sinks, sink_softmax
from megatron.model.sinks import make_softmax_offset
from megatron.mpu.sharding import qkv_meta
from megatron.model.spec import make_norm
from megatron.mpu import checkpoint, get_rng_tracker
from megatron.mpu.layers import ColumnParallelLinear, RowParallelLinear, divide, init_normal, \
    scaled_init_normal
from megatron.mpu.mappings import (copy_to_tensor_model_parallel_region, group_rank, group_size,
                                   sum_replica_grads)


def windowed_mask(mask, sq: int, sk: int, window, device):
    """`mask` (None: causal) with the sliding window's hidden keys added; unchanged when
    no key falls outside the window."""
    if effective_window(window, sk) is None:
        return mask
    hidden = outside_window(sq, sk, window, device)[None, None]
    return hidden if mask is None else mask.bool() | hidden


def chunked_mask(mask, sq: int, sk: int, chunk, device):
    """`mask` (None: causal) with the keys outside each query's attention chunk hidden
    (--attention-chunk-size: query i sees key j <= i when i // chunk == j // chunk);
    unchanged without a chunk or when every position is in the first one."""
    if chunk is None or sk <= chunk:
        return mask
    query = torch.arange(sk - sq, sk, device=device)[:, None]
    key = torch.arange(sk, device=device)[None, :]
    hidden = ((key > query) | (key // chunk != query // chunk))[None, None]
    return hidden if mask is None else mask.bool() | hidden


def fold_chunks(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """[s, b, ...] -> [chunk, s / chunk x b, ...]: each attention chunk a sequence of its own."""
    s, b = t.shape[:2]
    return t.reshape(s // chunk, chunk, b, *t.shape[2:]).transpose(0, 1).reshape(
        chunk, s // chunk * b, *t.shape[2:])


def unfold_chunks(t: torch.Tensor, batch: int) -> torch.Tensor:
    """The inverse of `fold_chunks` for a context [chunk, s / chunk x b, h]."""
    chunk, rows = t.shape[:2]
    return t.reshape(chunk, rows // batch, batch, *t.shape[2:]).transpose(0, 1).reshape(
        chunk * (rows // batch), batch, *t.shape[2:])


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """--qk-l2-norm: x / sqrt(mean(x^2) + eps) over each head's channels, in float32 (HF's
    Llama4TextL2Norm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def temperature_scales(positions: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """--attn-temperature-tuning's query multipliers of float `positions` [s]:
    log(floor((p + 1) / floor_scale) + 1) x scale + 1, as [s, 1, 1, 1]."""
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / cfg.attn_temperature_floor_scale))
    return (scales * cfg.attn_temperature_scale + 1.0)[:, None, None, None]


def _kernel_values(q, v):
    """v as the CPU kernel takes it: of q's head size. Multi-latent attention's narrower
    values are zero-padded (a copy; the kernel on them is still ~3.5x faster than SDPA on
    the unpadded ones, README), others pass as they are."""
    pad = q.shape[-1] - v.shape[-1]
    if pad <= 0 or q.device.type != "cpu" or q.shape[-1] % 16:
        return v
    return F.pad(v, (0, pad))


class CoreAttention(torch.nn.Module):
    """softmax(q k^T / sqrt(d)) v over this rank's heads, causal or with a mask; with
    --softmax-type learnable / off-by-one a sink logit per head (`softmax_offset`,
    megatron/model/sinks.py) joins each softmax's denominator."""

    def __init__(self, cfg: ModelConfig, layer_number: int, heads=None, device=None,
                 dtype=None):
        super().__init__()
        self.cfg = cfg
        self.layer_number = max(1, layer_number)
        self.window = cfg.window_for_layer(self.layer_number)
        self.chunk = cfg.chunk_for_layer(self.layer_number)
        self.dropout_p = cfg.attention_dropout
        offset = make_softmax_offset(cfg.softmax_type, heads or cfg.num_attention_heads,
                                     cfg.init_method_std, device, dtype)
        if isinstance(offset, torch.nn.Parameter) or offset is None:
            self.softmax_offset = offset
        else:  # off-by-one: a fixed 0 logit, not saved
            self.register_buffer("softmax_offset", offset, persistent=False)

    def sinks(self, heads=None):
        """The sink logits of this rank's heads (a slice of them: `heads`), or None."""
        if self.softmax_offset is None or heads is None:
            return self.softmax_offset
        return self.softmax_offset[heads]

    def forward(self, q, k, v, mask, bias=None, heads=None):
        """q [sq, b, np, hn], k / v [sk, b, np, hn] (sk >= sq: the queries are the last
        sq positions); bias: ALiBi scores [np, 1, sk] or None; heads: the slice of this
        rank's heads that q holds (context-parallel a2a), None: all. Attention chunks:
        each its own sequence when they tile the causal queries, else a mask."""
        sq, sk, chunk = q.shape[0], k.shape[0], self.chunk
        if chunk is not None and sk > chunk:
            if mask is None and bias is None and sq == sk and sq % chunk == 0:
                batch = q.shape[1]
                q, k, v = (fold_chunks(t, chunk) for t in (q, k, v))
                return unfold_chunks(self._attend(q, k, v, None, None, heads), batch)
            mask = chunked_mask(mask, sq, sk, chunk, q.device)
        return self._attend(q, k, v, mask, bias, heads)

    def _attend(self, q, k, v, mask, bias, heads):
        """A sliding window is our kernel's (it skips the key blocks before each row's
        window) or a mask for the other paths."""
        window = effective_window(self.window, k.shape[0])
        sinks = self.sinks(heads)
        kernel_v = _kernel_values(q, v) if mask is None and bias is None else v
        if self._use_cpu_kernel(q, k, kernel_v, mask, bias, window, sinks is not None):
            return self._cpu_kernel(q, k, kernel_v, v.shape[-1], sinks, window)
        mask = windowed_mask(mask, q.shape[0], k.shape[0], self.window, q.device)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # -> [b, np, s, hn]
        with_sinks = "" if sinks is None else f", {self.cfg.softmax_type} sinks"
        if self._use_sdpa(mask, q, bias):
            fused.announce("attention", f"SDPA ({self.cfg.attention_impl}{with_sinks})")
            context = self._sdpa(q, k, v, mask, bias, sinks)
        else:
            fused.announce("attention", f"explicit softmax(q k^T) v ({self.cfg.attention_impl}, "
                                        f"fused softmax {'on' if self._fusion() else 'off'}"
                                        f"{with_sinks})")
            context = self._explicit(q, k, v, mask, bias, sinks)
        b, n, s, d = context.shape
        return context.permute(2, 0, 1, 3).reshape(s, b, n * d)

    def _cpu_kernel(self, q, k, v, value_dim: int, sinks=None, window=None):
        """Our CPU kernel (sinks: this rank's sink logits or None; window: a sliding window
        or None); values zero-padded to the q / k head size (`_kernel_values`) give outputs
        whose padded channels are dropped here."""
        p = self._dropout_p()
        with_sinks = "" if sinks is None else f", {self.cfg.softmax_type} sinks"
        with_window = "" if window is None else f", window {window}"
        fused.announce("attention", f"our CPU kernel ({self.cfg.attention_impl}, "
                                    f"{fused.cpu_kernels_isa()}, dropout {p}{with_sinks}"
                                    f"{with_window})")
        seed = None
        if p > 0:
            with get_rng_tracker().fork():  # TP ranks: the model-parallel generator
                seed = fused.attention_dropout_seed()
        scale = self.cfg.softmax_scale or 1.0 / math.sqrt(q.shape[-1])
        out = fused.causal_attention(q, k, v, scale, p, seed, sinks, window)
        if value_dim == v.shape[-1]:
            return out
        s, b, heads = q.shape[:3]
        return out.view(s, b, heads, -1)[..., :value_dim].reshape(s, b, heads * value_dim)

    def _dropout_p(self) -> float:
        return self.dropout_p if self.training else 0.0

    def _use_cpu_kernel(self, q, k, v, mask, bias, window=None, sinks: bool = False):
        """auto, with fusions on: our CPU flash-attention kernel (attention dropout, a
        sliding window and sinks included) for causal self-attention, where it is faster
        than the other path on this machine (fused.causal_attention_preferred)."""
        return (self.cfg.attention_impl == "auto" and self._fusion() and mask is None
                and bias is None
                and fused.causal_attention_preferred(q, k, v, self._dropout_p(), window, sinks))

    def _use_sdpa(self, mask, q, bias):
        """auto: SDPA for plain causal attention, except where our path is faster or
        needed: explicit masks (a sliding window's too: in bfloat16 SDPA with a mask is
        unfused math, seconds a step), ALiBi, fp16 layer scaling, and dropout on CPUs (SDPA
        then falls back to unfused math with slow Bernoulli sampling). sdpa: always (ALiBi
        then goes in as a float mask)."""
        impl = self.cfg.attention_impl
        if impl == "sdpa":
            return True
        if impl == "auto":
            cpu_dropout = self.training and self.dropout_p > 0 and q.device.type == "cpu"
            scaled_fp16 = q.dtype == torch.float16 and self.cfg.apply_query_key_layer_scaling
            return mask is None and bias is None and not (cpu_dropout or scaled_fp16)
        return False

    def _sdpa(self, q, k, v, mask, bias, sinks=None):
        p = self.dropout_p if self.training else 0.0
        sq, sk = q.shape[2], k.shape[2]
        if sinks is not None:
            hidden = mask.bool() if mask is not None else future_keys(sq, sk, q.device)
            with get_rng_tracker().fork() if p > 0 else contextlib.nullcontext():
                return sdpa_with_sinks(q, k, v, hidden, sinks, p, bias, self.cfg.softmax_scale)
        causal = mask is None and sq == sk and bias is None
        attn_mask = None
        if not causal:
            hidden = mask.bool() if mask is not None else future_keys(sq, sk, q.device)
            if bias is None:
                attn_mask = ~hidden
            else:
                attn_mask = bias.expand(-1, sq, sk).masked_fill(hidden, float("-inf"))
        with get_rng_tracker().fork() if p > 0 else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p,
                                                  is_causal=causal, scale=self.cfg.softmax_scale)

    def _explicit(self, q, k, v, mask, bias, sinks=None):
        coeff = self.layer_number if self.cfg.apply_query_key_layer_scaling else 1.0
        scores = torch.matmul(q, k.transpose(-1, -2))
        if self.cfg.softmax_scale is None:
            scores = scores / (math.sqrt(q.shape[-1]) * coeff)
        else:
            scores = scores * (self.cfg.softmax_scale / coeff)
        if bias is not None:
            scores = scores + (bias / coeff if coeff != 1.0 else bias)
        if sinks is not None:
            hidden = mask.bool() if mask is not None else future_keys(*scores.shape[-2:], q.device)
            probs = sink_softmax(scores * coeff, hidden, sinks)
        else:
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

    QKV rows come in query groups, each [q heads of the group, k, v] (with one group
    per head, as GPT-2: [head, (q, k, v), head_dim]). A TP shard holds whole groups,
    or, when TP exceeds the groups, its query heads and a replica of its group's
    k / v (megatron.mpu.sharding). Positions: RoPE rotates q and k, ALiBi biases
    the scores; with `inference_params` (a KV cache) keys and values of earlier
    positions come from the cache and positions start at its length.
    """

    def __init__(self, cfg: ModelConfig, layer_number: int, tp_group, device, dtype):
        super().__init__()
        self.cfg = cfg
        self.layer_number = layer_number
        self.tp_group = tp_group
        tp = group_size(tp_group)
        self.heads_per_partition = divide(cfg.num_attention_heads, tp)
        self.groups_per_partition = max(cfg.num_query_groups // tp, 1)
        self.q_per_group = self.heads_per_partition // self.groups_per_partition
        local_rows = (self.heads_per_partition + 2 * self.groups_per_partition) * cfg.kv_channels
        common = dict(tp_group=tp_group, sequence_parallel=cfg.sequence_parallel,
                      device=device, dtype=dtype)
        self.query_key_value = ColumnParallelLinear(
            cfg.hidden_size, tp * local_rows, bias=cfg.add_bias_linear or cfg.add_qkv_bias,
            init_method=init_normal(cfg.init_method_std), **common)
        for p in self.query_key_value.parameters():
            p.sharding = qkv_meta(cfg.num_query_groups, cfg.num_attention_heads, cfg.kv_channels)
        if cfg.qk_layernorm:
            self.q_layernorm = make_norm(cfg, device, dtype, cfg.kv_channels, sequence_parallel=False)
            self.k_layernorm = make_norm(cfg, device, dtype, cfg.kv_channels, sequence_parallel=False)
        number = max(1, layer_number)
        self.rotary = (RotaryEmbedding(cfg, cfg.rotary_base_for_layer(number),
                                       cfg.rope_scaled_for_layer(number))
                       if cfg.uses_rope(number) else None)
        self.alibi = (AlibiBias(cfg, group_rank(tp_group), tp)
                      if cfg.position_embedding_type == "alibi" else None)
        self.core_attention = CoreAttention(cfg, layer_number, self.heads_per_partition,
                                            device, dtype)
        self.cp_group, self.cp_comm_type = None, "p2p"  # set by enable_context_parallel
        self.dense = RowParallelLinear(
            cfg.query_projection_size, cfg.hidden_size, bias=cfg.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True,
            init_method=scaled_init_normal(cfg.init_method_std, cfg.num_layers), **common)

    def _qkv(self, hidden):
        """The QKV projection; with TP > query groups the k / v rows are replicas whose
        gradients are summed over the ranks sharing them."""
        replicas = group_size(self.tp_group) // self.cfg.num_query_groups
        if replicas <= 1:
            return self.query_key_value(hidden)
        rows = 2 * self.cfg.kv_channels
        params = {n: sum_replica_grads(p, rows, replicas, self.tp_group)
                  for n, p in self.query_key_value.named_parameters()}
        return torch.func.functional_call(self.query_key_value, params, (hidden,))

    def _split_qkv(self, hidden):
        qkv = self._qkv(hidden)
        s, b, _ = qkv.shape
        d = self.cfg.kv_channels
        qkv = qkv.view(s, b, self.groups_per_partition, (self.q_per_group + 2) * d)
        q, k, v = torch.split(qkv, [self.q_per_group * d, d, d], dim=-1)
        return q.reshape(s, b, self.heads_per_partition, d), k, v

    def _head_norm(self, norm, x):
        """q / k layer norm; its weights see only this rank's heads, so their
        gradients are summed over TP (identity forward, all-reduce backward)."""
        if group_size(self.tp_group) == 1:
            return norm(x)
        params = {n: copy_to_tensor_model_parallel_region(p, self.tp_group)
                  for n, p in norm.named_parameters()}
        return torch.func.functional_call(norm, params, (x,))

    def _expand_groups(self, t):
        """[s, b, groups, d] -> [s, b, heads, d]: each query head gets its group's k / v."""
        if self.q_per_group == 1:
            return t
        s, b, g, d = t.shape
        return t.unsqueeze(3).expand(s, b, g, self.q_per_group, d).reshape(s, b, g * self.q_per_group, d)

    def forward(self, hidden, mask, inference_params=None):
        q, k, v = self._split_qkv(hidden)
        if self.cfg.qk_layernorm:
            q, k = self._head_norm(self.q_layernorm, q), self._head_norm(self.k_layernorm, k)
        if self.rotary is not None:
            offset = 0 if inference_params is None else inference_params.length
            cos, sin = self.rotary(q.shape[0], offset, q.device, positions=self._cp_positions(q))
            interleaved = self.cfg.rotary_interleaved
            q, k = apply_rotary(q, cos, sin, interleaved), apply_rotary(k, cos, sin, interleaved)
        q, k = self._llama4_scaling(q, k, inference_params)
        if inference_params is not None:
            k, v = inference_params.update(self.layer_number, k, v)
        return self.dense(self._attention(q, k, v, mask))

    def _llama4_scaling(self, q, k, inference_params):
        """--qk-l2-norm on the RoPE layers (after RoPE), --attn-temperature-tuning on the
        NoPE layers (at the tokens' global positions)."""
        number = max(1, self.layer_number)
        if self.cfg.l2_norm_for_layer(number):
            eps = self.cfg.layernorm_epsilon
            q, k = l2_norm(q, eps), l2_norm(k, eps)
        if self.cfg.temperature_for_layer(number):
            positions = self._cp_positions(q)
            if positions is None:
                offset = 0 if inference_params is None else inference_params.length
                positions = torch.arange(offset, offset + q.shape[0], device=q.device)
            q = (q * temperature_scales(positions, self.cfg).to(q.device)).to(q.dtype)
        return q, k

    def _attention(self, q, k, v, mask):
        """The context [s, b, heads * head_dim]: here or across CP, recomputed in the
        backward under selective recomputation."""
        attend = self._attend if group_size(self.cp_group) == 1 else self._attend_across_cp
        if self.cfg.recompute_granularity == "selective" and self.training:
            return checkpoint(attend, q, k, v, mask)
        return attend(q, k, v, mask)

    def _attend(self, q, k, v, mask):
        k, v = self._expand_groups(k), self._expand_groups(v)
        bias = None if self.alibi is None else self.alibi(k.shape[0], q.dtype, q.device)
        return self.core_attention(q, k, v, mask, bias)

    def _attend_across_cp(self, q, k, v, mask):
        """Attention of this rank's chunks over the whole sequence (context parallel)."""
        if self.cp_comm_type == "p2p":
            return cp.ring_attention(q, k, v, self.cp_group, self.cfg.softmax_scale,
                                     fusion=self.core_attention._fusion(),
                                     sinks=self.core_attention.sinks())
        return cp.a2a_attention(q, self._expand_groups(k), self._expand_groups(v),
                                self.cp_group, self.core_attention)

    def _cp_positions(self, q):
        """Global positions of the local tokens under context parallelism, else None."""
        size = group_size(self.cp_group)
        if size == 1:
            return None
        return cp.cp_positions(q.shape[0], group_rank(self.cp_group), size, q.device)
