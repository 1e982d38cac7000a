"""Text generation: sampling (greedy, top-k, top-p, temperature) and KV-cache decoding.

The inference set-up shared by the entry points (model and tokenizer flags
read back from a checkpoint) lives in `megatron.training.checkpoint_setup`.
"""
from megatron.text_generation.generation import generate, generate_text
from megatron.text_generation.inference import (GenerationError, KVCache, check_generation_model,
                                                forward_full, forward_with_cache)
from megatron.text_generation.sampling import (SamplingParams, apply_temperature,
                                               mask_padded_vocab, sample, top_k_filter,
                                               top_p_filter)

__all__ = ["generate", "generate_text", "GenerationError", "KVCache", "check_generation_model",
           "forward_full", "forward_with_cache", "SamplingParams", "apply_temperature",
           "mask_padded_vocab", "sample", "top_k_filter", "top_p_filter"]
