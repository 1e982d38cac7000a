"""Incremental decoding with a key/value cache, on the weights of a `GPTModel`.

The training forward recomputes every position; generation only needs the
newest one. `forward_with_cache` walks the model's own modules (embedding,
layer norms, the tensor-parallel QKV / output / MLP layers, the tied head) and
replaces only the attention core: the keys and values of earlier positions come
from a `KVCache`, so each step costs one position per layer. Tensor
parallelism works unchanged: each rank caches its own heads, the row-parallel
layers all-reduce as in training and the logits are gathered over the vocabulary.

Only whole models run here (first and last pipeline stage in one module);
sequence parallelism is a training-time layout and is refused.
"""
from typing import List, Optional

import torch
import torch.nn.functional as F

from megatron.mpu.mappings import gather_from_tensor_model_parallel_region


class GenerationError(ValueError):
    """A model or request that generation cannot serve; the message says what to do."""


def check_generation_model(model) -> None:
    """Raise GenerationError unless `model` is a whole GPTModel without sequence parallelism."""
    if not (getattr(model, "pre_process", False) and getattr(model, "post_process", False)):
        raise GenerationError(
            "generation with pipeline parallelism (--pipeline-model-parallel-size > 1) is not "
            "supported; re-shard the checkpoint to one pipeline stage with "
            "tools/merge_mp_partitions.py --target-pipeline-model-parallel-size 1")
    if model.cfg.sequence_parallel:
        raise GenerationError("generation needs a model built without sequence parallelism; "
                              "build it with ModelConfig.sequence_parallel=False (the weights "
                              "are the same)")


class KVCache:
    """Keys and values [max_len, b, heads, head_dim] of each layer, filled front to back.

    `length` positions are valid; `update` writes the next positions of one layer
    and returns all valid ones, `advance` moves `length` once every layer is done.
    """

    def __init__(self, num_layers: int, max_len: int, batch: int, heads: int, head_dim: int,
                 dtype: torch.dtype, device):
        shape = (max_len, batch, heads, head_dim)
        self.keys: List[torch.Tensor] = [torch.empty(shape, dtype=dtype, device=device)
                                         for _ in range(num_layers)]
        self.values: List[torch.Tensor] = [torch.empty(shape, dtype=dtype, device=device)
                                           for _ in range(num_layers)]
        self.max_len = max_len
        self.length = 0

    @classmethod
    def for_model(cls, model, batch: int, max_len: int) -> "KVCache":
        layers = model.language_model.encoder.layers
        heads = layers[0].self_attention.heads_per_partition if len(layers) else 1
        weight = model.head_weight()
        return cls(len(layers), max_len, batch, heads, model.cfg.kv_channels, weight.dtype,
                   weight.device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        end = self.length + k.shape[0]
        if end > self.max_len:
            raise GenerationError(f"KV cache holds {self.max_len} positions; "
                                  f"{end} were requested")
        self.keys[layer][self.length:end] = k
        self.values[layer][self.length:end] = v
        return self.keys[layer][:end], self.values[layer][:end]

    def advance(self, steps: int) -> None:
        self.length += steps


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     offset: int) -> torch.Tensor:
    """Causal attention of new queries over cached plus new keys.

    q: [sq, b, np, hn] at absolute positions offset .. offset + sq - 1;
    k, v: [sk, b, np, hn] for positions 0 .. sk - 1. Returns [sq, b, np * hn].
    """
    sq, sk = q.shape[0], k.shape[0]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, np, s, hn]
    mask = None
    if sq > 1:
        query_pos = torch.arange(offset, offset + sq, device=q.device).unsqueeze(1)
        mask = torch.arange(sk, device=q.device).unsqueeze(0) <= query_pos  # True = may attend
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    b, n, _, d = context.shape
    return context.permute(2, 0, 1, 3).reshape(sq, b, n * d)


def _attention_step(attention, hidden, cache: KVCache, index: int):
    """The model's self-attention (its QKV and output layers) with the cached core."""
    qkv = attention.query_key_value(hidden)
    s, b, _ = qkv.shape
    qkv = qkv.view(s, b, attention.heads_per_partition, 3 * attention.cfg.kv_channels)
    q, k, v = qkv.chunk(3, dim=-1)
    keys, values = cache.update(index, k, v)
    return attention.dense(cached_attention(q, keys, values, cache.length))


def _add_residual(out_and_bias, residual):
    out, bias = out_and_bias
    return residual + (out if bias is None else out + bias)


def _layer_step(layer, hidden, cache: KVCache, index: int):
    """One transformer layer at inference (dropout off): pre-LN attention, then MLP."""
    attn = _attention_step(layer.self_attention, layer.input_layernorm(hidden), cache, index)
    hidden = _add_residual(attn, hidden)
    return _add_residual(layer.mlp(layer.post_attention_layernorm(hidden)), hidden)


def gathered_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [b, s, V] from final hidden states [s, b, h]."""
    logits = F.linear(hidden, model.head_weight())
    logits = gather_from_tensor_model_parallel_region(logits, model.tp_group)
    return logits.transpose(0, 1)


@torch.no_grad()
def forward_with_cache(model, tokens: torch.Tensor, cache: KVCache,
                       last_only: bool = True) -> torch.Tensor:
    """Run `tokens` [b, s] (the positions after the cached ones) through `model`.

    Returns logits [b, 1, V] of the last position (or [b, s, V] with
    last_only=False), gathered over the vocabulary on every TP rank.
    """
    check_generation_model(model)
    start, s = cache.length, tokens.shape[1]
    positions = torch.arange(start, start + s, device=tokens.device).unsqueeze(0).expand_as(tokens)
    lm = model.language_model
    hidden = lm.embedding(tokens, positions)  # [s, b, h]
    for index, layer in enumerate(lm.encoder.layers):
        hidden = _layer_step(layer, hidden, cache, index)
    cache.advance(s)
    if last_only:
        hidden = hidden[-1:]
    return gathered_logits(model, lm.encoder.final_layernorm(hidden))


@torch.no_grad()
def forward_full(model, tokens: torch.Tensor, attention_mask: Optional[torch.Tensor] = None):
    """Logits [b, s, V] of the model's ordinary forward, gathered over the vocabulary."""
    check_generation_model(model)
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    logits = model(tokens, positions, attention_mask)
    if logits.shape[-1] != model.cfg.padded_vocab_size:
        logits = gather_from_tensor_model_parallel_region(logits, model.tp_group)
    return logits
