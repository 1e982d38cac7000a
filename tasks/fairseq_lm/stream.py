"""fairseq's token stream and its evaluation blocks.

fairseq-preprocess encodes each line (stripped) to dictionary ids and appends `</s>`
(an empty line is `</s>` alone); the lines of the file form one stream S of n tokens.
fairseq-eval-lm with --tokens-per-sample T and --context-window C scores S in blocks
of B = T - C new tokens: target S[j] is predicted from input S[j - 1] (`</s>` before
S[0]), and each block's inputs are preceded by up to C earlier inputs, scored not.
Every token of S is scored once, so n is fairseq's token count.
"""
import math
from dataclasses import dataclass
from typing import List, Tuple

import numpy as np

from tasks.zeroshot_gpt.datasets import TaskDataError


def encode_lines(text: str, tokenizer) -> List[int]:
    """S: each line's ids followed by `</s>` (tokenizer.eod), as fairseq-preprocess."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines = lines[:-1]
    stream = []
    for line in lines:
        line = line.strip()
        stream.extend(tokenizer.tokenize(line) if line else [])
        stream.append(tokenizer.eod)
    return stream


@dataclass
class FairseqBlocks:
    """Samples (tokens [T + 1], loss mask [T]) of fairseq-eval-lm's blocks over a stream."""

    stream: List[int]
    tokens_per_sample: int
    context_window: int
    eos: int
    num_original_tokens: int

    def __post_init__(self):
        if not 0 <= self.context_window < self.tokens_per_sample:
            raise TaskDataError(f"--context-window ({self.context_window}) must be in 0.."
                                f"{self.tokens_per_sample - 1} (below --tokens-per-sample)")
        if not self.stream:
            raise TaskDataError("the evaluation text has no tokens")
        self._padded = [self.eos] + list(self.stream)  # inputs, then the last target

    @property
    def block(self) -> int:
        return self.tokens_per_sample - self.context_window

    @property
    def num_tokenized_tokens(self) -> int:
        return len(self.stream)

    def __len__(self) -> int:
        return math.ceil(len(self.stream) / self.block)

    def __getitem__(self, idx: int) -> Tuple[np.ndarray, np.ndarray]:
        first = idx * self.block
        last = min(first + self.block, len(self.stream))
        start = max(0, first - self.context_window)
        window = self._padded[start:last + 1]
        tokens = np.full(self.tokens_per_sample + 1, self.eos, dtype=np.int64)
        tokens[:len(window)] = window
        mask = np.zeros(self.tokens_per_sample, dtype=np.float32)
        mask[first - start:last - start] = 1.0
        return tokens, mask


def read_fairseq_stream(path: str, tokenizer, detokenize, tokens_per_sample: int,
                        context_window: int) -> FairseqBlocks:
    """Blocks over the file's (detokenised) lines; words counted in the file as given."""
    try:
        with open(path, "rb") as f:
            raw = f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise TaskDataError(f"cannot read --valid-data {path}: {err}") from None
    num_words = len(raw.strip().split(" "))
    stream = encode_lines(detokenize(raw), tokenizer)
    return FairseqBlocks(stream, tokens_per_sample, context_window, tokenizer.eod, num_words)


def fairseq_metrics(total_nats: float, num_tokens: int, num_words: int) -> dict:
    """fairseq-eval-lm's base-2 loss and perplexity, and the perplexity renormalised to
    words: 2 ** (loss * bpe tokens / word tokens) (the Megatron-11b README's n / m)."""
    loss = total_nats / num_tokens / math.log(2)
    return {"loss (base 2)": loss, "ppl": 2 ** loss,
            "renormalized ppl": 2 ** (loss * num_tokens / num_words),
            "bpe tokens": num_tokens, "word tokens": num_words}


def format_fairseq(metrics: dict) -> str:
    """fairseq-eval-lm's line, then ours with the renormalisation and both counts."""
    return (f"Loss (base 2): {metrics['loss (base 2)']:.4f}, Perplexity: {metrics['ppl']:.2f}\n"
            f" validation results on WIKITEXT103 (fairseq) | loss (base 2): "
            f"{metrics['loss (base 2)']:.6f} | ppl: {metrics['ppl']:.6f} | renormalized ppl: "
            f"{metrics['renormalized ppl']:.6f} | bpe tokens: {metrics['bpe tokens']} | "
            f"word tokens: {metrics['word tokens']} |")
