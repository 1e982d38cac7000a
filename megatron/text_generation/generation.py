"""`generate()`: continue a batch of prompts with a GPT model.

Prompts of different lengths share one batch as in Megatron: the batch starts
decoding at the shortest prompt; a row whose prompt is longer keeps its own
tokens until its prompt is consumed, then takes sampled ones. Each row stops at
`max_new_tokens` new tokens or (with `eod_stop`) after it emits the
end-of-document token; the batch stops when every row has.

With tensor parallelism every rank of the TP group runs the same steps and the
token chosen on TP rank 0 is broadcast, so all ranks continue identically.
"""
from typing import List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from megatron.mpu.mappings import group_size
from megatron.text_generation.inference import (GenerationError, KVCache, check_generation_model,
                                                forward_full, forward_with_cache)
from megatron.text_generation.sampling import SamplingParams, sample

Prompt = Union[str, Sequence[int]]


def prompt_ids(prompt: Prompt, tokenizer, vocab_limit: int) -> List[int]:
    """Token ids of one prompt; an empty prompt becomes [eod] (unconditional sampling)."""
    ids = tokenizer.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not ids:
        return [tokenizer.eod]
    bad = [t for t in ids if not 0 <= t < vocab_limit]
    if bad:
        raise GenerationError(f"prompt token id {bad[0]} is outside the model's vocabulary "
                              f"0..{vocab_limit - 1}")
    return ids


def broadcast_from_tp_rank0(tensor: torch.Tensor, tp_group) -> torch.Tensor:
    """Make every TP rank hold TP rank 0's `tensor` (in place; no-op without TP)."""
    if group_size(tp_group) > 1:
        dist.broadcast(tensor, src=dist.get_global_rank(tp_group, 0), group=tp_group)
    return tensor


def _check_length(contexts: List[List[int]], max_new_tokens: int, max_positions: int) -> int:
    if max_new_tokens < 0:
        raise GenerationError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    longest = max(len(c) for c in contexts)
    total = longest + max_new_tokens
    if total > max_positions:
        raise GenerationError(
            f"the longest prompt ({longest} tokens) plus max_new_tokens ({max_new_tokens}) is "
            f"{total} positions but the model has --max-position-embeddings {max_positions}; "
            f"shorten the prompt or ask for at most {max(0, max_positions - longest)} new tokens")
    return total


class _Batch:
    """Token buffer [b, total] and per-row progress of one generate() call."""

    def __init__(self, contexts: List[List[int]], total: int, max_new_tokens: int, eod: int,
                 device):
        self.tokens = torch.full((len(contexts), total), eod, dtype=torch.long, device=device)
        for i, ids in enumerate(contexts):
            self.tokens[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        self.lengths = torch.tensor([len(c) for c in contexts], device=device)
        self.limits = self.lengths + max_new_tokens
        self.done = self.limits <= self.lengths  # max_new_tokens == 0
        self.eod = eod

    def place(self, pos: int, chosen: torch.Tensor, eod_stop: bool) -> None:
        """Write the chosen tokens at `pos` for rows past their prompt; update `done`."""
        generating = (pos >= self.lengths) & ~self.done
        self.tokens[:, pos] = torch.where(generating, chosen, self.tokens[:, pos])
        if eod_stop:
            self.done |= generating & (chosen == self.eod)
        self.done |= pos + 1 >= self.limits

    def new_tokens(self, end: int, eod_stop: bool) -> List[List[int]]:
        out = []
        for i in range(self.tokens.shape[0]):
            stop = min(int(self.limits[i]), end)
            ids = self.tokens[i, int(self.lengths[i]):stop].tolist()
            if eod_stop and self.eod in ids:
                ids = ids[:ids.index(self.eod)]
            out.append(ids)
        return out


@torch.no_grad()
def generate(model, tokenizer, prompts: Sequence[Prompt], max_new_tokens: int, *,
             greedy: bool = False, top_k: int = 0, top_p: float = 0.0, temperature: float = 1.0,
             seed: Optional[int] = None, eod_stop: bool = True,
             use_cache: bool = True) -> List[List[int]]:
    """New token ids for each prompt (str or ids), the stopping eod excluded.

    use_cache=False recomputes the whole sequence each step (slow; a reference).
    `seed` makes sampling reproducible; without it the global RNG is used.
    """
    check_generation_model(model)
    params = SamplingParams(greedy=greedy, top_k=top_k, top_p=top_p, temperature=temperature)
    cfg = model.cfg
    contexts = [prompt_ids(p, tokenizer, cfg.padded_vocab_size) for p in prompts]
    if not contexts:
        return []
    total = _check_length(contexts, max_new_tokens, cfg.max_position_embeddings)
    device = model.head_weight().device
    batch = _Batch(contexts, total, max_new_tokens, tokenizer.eod, device)
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    cache = KVCache.for_model(model, len(contexts), total) if use_cache else None
    was_training = model.training
    model.eval()
    try:
        pos = _decode(model, batch, cache, params, tokenizer.vocab_size, generator, eod_stop)
    finally:
        model.train(was_training)
    return batch.new_tokens(pos, eod_stop)


def _decode(model, batch: _Batch, cache: Optional[KVCache], params, vocab_size, generator,
            eod_stop) -> int:
    """Fill batch.tokens from the shortest prompt on; returns the end position."""
    pos = int(batch.lengths.min())
    total = batch.tokens.shape[1]
    while pos < total and not bool(batch.done.all()):
        if cache is not None:
            logits = forward_with_cache(model, batch.tokens[:, cache.length:pos], cache)[:, -1]
        else:
            logits = forward_full(model, batch.tokens[:, :pos])[:, -1]
        chosen = sample(logits, params, vocab_size, generator)
        chosen = broadcast_from_tp_rank0(chosen, model.tp_group)
        batch.place(pos, chosen, eod_stop)
        pos += 1
    return pos


def generate_text(model, tokenizer, prompts: Sequence[str], max_new_tokens: int,
                  **kwargs) -> List[str]:
    """`generate` then detokenize each continuation."""
    return [tokenizer.detokenize(ids)
            for ids in generate(model, tokenizer, prompts, max_new_tokens, **kwargs)]
