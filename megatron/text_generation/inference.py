"""Incremental decoding with a key/value cache, through the model's own forward.

The training forward recomputes every position; generation only needs the
newest one. `forward_with_cache` calls the model with a `KVCache` as
`inference_params`: each attention module stores its keys and values there and
attends over the cached ones, with positions (learned, RoPE, ALiBi) starting at
the cache's length, so each step costs one position per layer. Tensor
parallelism works unchanged: each rank caches its own query groups, the
row-parallel layers all-reduce as in training and the logits are gathered over
the vocabulary.

Only whole models run here (first and last pipeline stage in one module);
sequence parallelism is a training-time layout and is refused.
"""
from typing import Dict, Optional

import torch

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
    """Keys and values [max_len, b, query groups of this rank, head_dim] of each layer
    (multi-latent attention: its latents [max_len, b, kv_lora_rank] and RoPE keys
    [max_len, b, 1, qk_pos_emb_head_dim]; allocated on first use), filled front to back; the attention modules read and
    write it (`inference_params`).

    `length` positions are valid: the next tokens' positions start there. `update`
    writes the next positions of one layer and returns all valid ones; `advance`
    moves `length` once every layer is done.
    """

    def __init__(self, max_len: int):
        self.keys: Dict[int, torch.Tensor] = {}
        self.values: Dict[int, torch.Tensor] = {}
        self.max_len = max_len
        self.length = 0

    @classmethod
    def for_model(cls, model, batch: int, max_len: int) -> "KVCache":
        """A cache of `max_len` positions for `model` (the batch size follows the tokens)."""
        return cls(max_len)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        end = self.length + k.shape[0]
        if end > self.max_len:
            raise GenerationError(f"KV cache holds {self.max_len} positions; "
                                  f"{end} were requested")
        if layer not in self.keys:
            self.keys[layer] = k.new_empty((self.max_len,) + tuple(k.shape[1:]))
            self.values[layer] = v.new_empty((self.max_len,) + tuple(v.shape[1:]))
        self.keys[layer][self.length:end] = k
        self.values[layer][self.length:end] = v
        return self.keys[layer][:end], self.values[layer][:end]

    def advance(self, steps: int) -> None:
        self.length += steps


def _gathered(model, logits: torch.Tensor) -> torch.Tensor:
    """Logits over the whole (padded) vocabulary on every TP rank."""
    if logits.shape[-1] != model.cfg.padded_vocab_size:
        logits = gather_from_tensor_model_parallel_region(logits, model.tp_group)
    return logits


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
    logits = model(tokens, positions, inference_params=cache)
    cache.advance(s)
    if last_only:
        logits = logits[:, -1:]
    return _gathered(model, logits)


@torch.no_grad()
def forward_full(model, tokens: torch.Tensor, attention_mask: Optional[torch.Tensor] = None):
    """Logits [b, s, V] of the model's ordinary forward, gathered over the vocabulary."""
    check_generation_model(model)
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    return _gathered(model, model(tokens, positions, attention_mask))
