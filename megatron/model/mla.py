"""Multi-latent attention (DeepSeek-V2/V3; Megatron-Core's MLASelfAttention).

Keys and values come from one compressed latent per token, c = RMSNorm(W_dkv x)
[kv_lora_rank], expanded per head by W_ukv to [k_nope (qk_head_dim), v (v_head_dim)].
Position enters through a decoupled RoPE key k_pe [qk_pos_emb_head_dim], computed with
the latent (W_dkv's last rows) and shared by every head. Queries are W_uq RMSNorm(W_dq x)
(--q-lora-rank) or W_q x (no --q-lora-rank), per head [q_nope, q_pe]. Scores are
[q_nope, RoPE(q_pe)] . [k_nope, RoPE(k_pe)] times the softmax scale (mla.softmax_scale:
1 / sqrt(qk_head_dim + qk_pos_emb_head_dim), times YaRN's mscale_all_dim factor squared).
RoPE acts on the pe channels taken even-first ([x0, x2, ..., x1, x3, ...]), as
Megatron-Core and DeepSeek's interleaved weights do.

Tensor parallelism: heads are split (W_uq, W_q, W_ukv column-parallel, the output
row-parallel); the down-projections W_dq, W_dkv and their norms are replicated and see
this rank's tokens (all of them, or its sequence slice under sequence parallelism). The
compressed query and latent enter the up-projections through the usual column-parallel
input (all-reduce, or sequence all-gather, of the gradient), and k_pe through the same
reduction, so every gradient is the one-process gradient (replicated weights under
sequence parallelism sum their partial gradients over TP like the norms).

Generation caches, per token and layer, the normed latent and the rotated k_pe
(kv_lora_rank + qk_pos_emb_head_dim values, the same on every TP rank), not the
expanded keys and values; each step expands the cached latents again.
"""
import math

import torch
import torch.nn.functional as F

from megatron.config import ModelConfig
from megatron.config.mla import rope_magnitude, softmax_scale
from megatron.model.positions import RotaryEmbedding, apply_rotary
from megatron.model.spec import make_norm
from megatron.model.attention import CoreAttention, ParallelAttention
from megatron.mpu.layers import (ColumnParallelLinear, RowParallelLinear, _new_param, divide,
                                 init_normal, scaled_init_normal, set_parallel_attributes)
from megatron.mpu.mappings import (copy_to_tensor_model_parallel_region,
                                   gather_from_sequence_parallel_region, group_size)


class ReplicatedLinear(torch.nn.Module):
    """y = x W^T, W the same on every TP rank (sharding metadata: replicated); under
    sequence parallelism its gradient is a partial sum over TP (`sequence_parallel`)."""

    def __init__(self, input_size, output_size, init_method, sequence_parallel, device, dtype):
        super().__init__()
        self.weight = _new_param((output_size, input_size), device, dtype)
        set_parallel_attributes(self.weight, False, init_method=init_method)
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x):
        return F.linear(x, self.weight)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[x0, x1, x2, x3, ...] -> [x0, x2, ..., x1, x3, ...] along the last dimension."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLASelfAttention(ParallelAttention):
    """Multi-latent self-attention over this TP rank's heads; [s, b, h] in and out.

    It shares ParallelAttention's attention paths (one process, ring and all-to-all
    context parallelism, selective recomputation) but builds its own projections, so
    ParallelAttention.__init__ is not run.
    """

    def __init__(self, cfg: ModelConfig, layer_number: int, tp_group, device, dtype):
        torch.nn.Module.__init__(self)
        self.cfg, self.layer_number, self.tp_group = cfg, layer_number, tp_group
        self.heads_per_partition = divide(cfg.num_attention_heads, group_size(tp_group))
        self.groups_per_partition, self.q_per_group = self.heads_per_partition, 1
        self.q_head_dim = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
        sp = cfg.sequence_parallel and group_size(tp_group) > 1
        init = init_normal(cfg.init_method_std)
        common = dict(tp_group=tp_group, sequence_parallel=cfg.sequence_parallel, bias=False,
                      init_method=init, device=device, dtype=dtype)
        heads = cfg.num_attention_heads
        if cfg.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(cfg.hidden_size, heads * self.q_head_dim,
                                                      **common)
        else:
            self.linear_q_down_proj = ReplicatedLinear(cfg.hidden_size, cfg.q_lora_rank, init,
                                                       sp, device, dtype)
            self.q_layernorm = make_norm(cfg, device, dtype, cfg.q_lora_rank)
            self.linear_q_up_proj = ColumnParallelLinear(cfg.q_lora_rank,
                                                         heads * self.q_head_dim, **common)
        self.linear_kv_down_proj = ReplicatedLinear(
            cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim, init, sp, device, dtype)
        self.kv_layernorm = make_norm(cfg, device, dtype, cfg.kv_lora_rank)
        self.linear_kv_up_proj = ColumnParallelLinear(
            cfg.kv_lora_rank, heads * (cfg.qk_head_dim + cfg.v_head_dim), **common)
        self._build_attention(cfg, layer_number, device, dtype)

    def _build_attention(self, cfg, layer_number, device, dtype):
        self.rotary = RotaryEmbedding(cfg)
        if cfg.rope_scaling_type == "yarn":
            self.rotary.magnitude = rope_magnitude(cfg)
        # CoreAttention (and ring attention) scale by 1 / sqrt(q head size): the queries
        # carry the rest of MLA's softmax scale
        self.query_scale = softmax_scale(cfg) * math.sqrt(self.q_head_dim)
        self.alibi = None
        self.core_attention = CoreAttention(cfg, layer_number)
        self.cp_group, self.cp_comm_type = None, "p2p"  # set by enable_context_parallel
        self.dense = RowParallelLinear(
            cfg.query_projection_size, cfg.hidden_size, bias=cfg.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True, tp_group=self.tp_group,
            sequence_parallel=cfg.sequence_parallel, device=device, dtype=dtype,
            init_method=scaled_init_normal(cfg.init_method_std, cfg.num_layers))

    def _query(self, hidden):
        """[s, b, local heads, q_head_dim] (the whole sequence under sequence parallelism)."""
        if self.cfg.q_lora_rank is None:
            q = self.linear_q_proj(hidden)
        else:
            q = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(hidden)))
        return q.view(q.shape[0], q.shape[1], self.heads_per_partition, self.q_head_dim)

    def _latent(self, hidden):
        """(normed latent [s_local, b, kv_lora_rank], k_pe [s, b, 1, qk_pos_emb_head_dim]):
        k_pe gathered over the sequence under sequence parallelism, its gradient summed
        over TP (each rank's heads use it)."""
        kv = self.linear_kv_down_proj(hidden)
        latent, k_pe = torch.split(kv, [self.cfg.kv_lora_rank, self.cfg.qk_pos_emb_head_dim], -1)
        if self.cfg.sequence_parallel:
            k_pe = gather_from_sequence_parallel_region(k_pe, self.tp_group)
        else:
            k_pe = copy_to_tensor_model_parallel_region(k_pe, self.tp_group)
        return self.kv_layernorm(latent), k_pe.unsqueeze(2)

    def _rope(self, q, k_pe, inference_params):
        """RoPE on q's pe channels and on k_pe, both taken even-first."""
        offset = 0 if inference_params is None else inference_params.length
        cos, sin = self.rotary(q.shape[0], offset, q.device, positions=self._cp_positions(q))
        q_nope, q_pe = torch.split(q, [self.cfg.qk_head_dim, self.cfg.qk_pos_emb_head_dim], -1)
        q_pe = apply_rotary(deinterleave(q_pe), cos, sin)
        return torch.cat((q_nope, q_pe), dim=-1), apply_rotary(deinterleave(k_pe), cos, sin)

    def _keys_values(self, latent, k_pe):
        """Expanded k [sk, b, local heads, q_head_dim] and v [.., v_head_dim]."""
        kv = self.linear_kv_up_proj(latent)
        kv = kv.view(kv.shape[0], kv.shape[1], self.heads_per_partition, -1)
        k_nope, v = torch.split(kv, [self.cfg.qk_head_dim, self.cfg.v_head_dim], dim=-1)
        k_pe = k_pe.expand(-1, -1, self.heads_per_partition, -1)
        return torch.cat((k_nope, k_pe), dim=-1), v

    def forward(self, hidden, mask, inference_params=None):
        q = self._query(hidden)
        latent, k_pe = self._latent(hidden)
        q, k_pe = self._rope(q, k_pe, inference_params)
        if inference_params is not None:  # the compressed cache: latent + rotated k_pe
            latent, k_pe = inference_params.update(self.layer_number, latent, k_pe)
        k, v = self._keys_values(latent, k_pe)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        return self.dense(self._attention(q, k, v, mask))
