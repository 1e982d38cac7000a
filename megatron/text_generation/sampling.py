"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus).

Pure functions of tensors (no communication, no model). `logits` are
[batch, vocab] rows; filters return new tensors with the removed entries set
to -inf, so they compose: temperature, then top-k or top-p, then sampling.
"""
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token; validated on creation."""

    greedy: bool = False
    """Take the most likely token (ignores temperature)."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 turns the filter off."""
    top_p: float = 0.0
    """Sample among the most likely tokens whose probabilities sum to >= top_p; 0 is off."""
    temperature: float = 1.0
    """Divides the logits before sampling: < 1 sharpens, > 1 flattens."""

    def __post_init__(self):
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1] (0 = off), got {self.top_p!r}")
        if not self.temperature > 0.0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}; "
                             "use greedy decoding for deterministic output")
        if self.top_k > 0 and self.top_p > 0.0:
            raise ValueError(f"top_k ({self.top_k}) and top_p ({self.top_p}) cannot both be set; "
                             "pick one")
        if self.greedy and (self.top_k > 1 or self.top_p > 0.0):
            raise ValueError(f"greedy decoding ignores top_k ({self.top_k}) and top_p "
                             f"({self.top_p}); drop them or drop greedy")


def mask_padded_vocab(logits: torch.Tensor, vocab_size: Optional[int]) -> torch.Tensor:
    """Forbid the padding ids >= vocab_size (rows added to divide the vocabulary over TP)."""
    if vocab_size is None or vocab_size >= logits.shape[-1]:
        return logits
    logits = logits.clone()
    logits[..., vocab_size:] = float("-inf")
    return logits


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return logits if temperature == 1.0 else logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (and any tied with the k-th); 0 keeps all."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability sums to >= p.

    A token survives when the probability mass of the tokens ranked above it is
    still < p, so the most likely token always survives. p = 0 or 1 keeps all.
    """
    if p <= 0.0 or p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    mass_above = torch.cumsum(probs, dim=-1) - probs
    remove_sorted = mass_above >= p
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def sample(logits: torch.Tensor, params: SamplingParams, vocab_size: Optional[int] = None,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next token ids [b] from logits [b, V] (V may include padding ids >= vocab_size)."""
    logits = mask_padded_vocab(logits.float(), vocab_size)
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    logits = apply_temperature(logits, params.temperature)
    logits = top_k_filter(logits, params.top_k)
    logits = top_p_filter(logits, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
