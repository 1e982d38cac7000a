"""Evaluation samples of the zero-shot tasks, with Megatron's semantics.

Every sample is `tokens` [seq_length + 1] (inputs are tokens[:-1], labels
tokens[1:]) and `loss_mask` [seq_length] marking the labels that are scored.

WIKITEXT103: the whole detokenized text is one token stream, read in windows of
seq_length + 1 tokens that start every `stride` tokens. The first window scores
all its labels, later ones only their last `stride` labels (the earlier ones
serve as context), so every label of the stream is scored exactly once.

LAMBADA: one sample per passage; only the tokens of the last word are scored,
and a passage counts as correct when all of them are predicted greedily. A
passage longer than the window keeps its last seq_length + 1 tokens (its
context is cut from the left); `LambadaExamples.num_truncated` counts them.
"""
import json
import math
from dataclasses import dataclass
from typing import List, Tuple

import numpy as np

from tasks.zeroshot_gpt.detokenizer import detokenize


class TaskDataError(ValueError):
    """Unusable evaluation data; the message names the file and the problem."""


def _padded(tokens: List[int], mask: List[int], length: int, pad_id: int):
    """Pad `tokens` and its per-token `mask` to `length`; the mask drops its first entry."""
    pad = length - len(tokens)
    tokens = np.array(tokens + [pad_id] * pad, dtype=np.int64)
    mask = np.array(mask + [0] * pad, dtype=np.float32)[1:]
    return tokens, mask


@dataclass
class WikitextWindows:
    """Overlapping windows over one token stream."""

    tokens: List[int]
    seq_length: int
    stride: int
    pad_id: int
    num_original_tokens: int

    def __post_init__(self):
        if not 1 <= self.stride <= self.seq_length:
            raise TaskDataError(f"--overlapping-eval ({self.stride}) must be in 1.."
                                f"{self.seq_length} (--seq-length)")
        if len(self.tokens) < 2:
            raise TaskDataError("the evaluation text has fewer than 2 tokens")

    @property
    def num_tokenized_tokens(self) -> int:
        return len(self.tokens)

    def __len__(self) -> int:
        targets = max(len(self.tokens) - 1 - self.stride, 0)
        return max(math.ceil(targets / self.stride) + 1, 1)

    def __getitem__(self, idx: int) -> Tuple[np.ndarray, np.ndarray]:
        start = idx * self.stride
        window = self.tokens[start:start + self.seq_length + 1]
        tokens, mask = _padded(window, [1] * len(window), self.seq_length + 1, self.pad_id)
        if idx > 0 and self.stride != self.seq_length:
            mask[:-self.stride] = 0.0  # already scored by the previous window
        return tokens, mask


def read_wikitext(path: str, tokenizer, seq_length: int, stride: int,
                  detokenizer: str = "wikitext") -> WikitextWindows:
    """Windows over the detokenized text file; counts its original (word) tokens."""
    try:
        with open(path, "rb") as f:
            raw = f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise TaskDataError(f"cannot read --valid-data {path}: {err}") from None
    num_original = len(raw.strip().split(" "))
    tokens = tokenizer.tokenize(detokenize(detokenizer, raw))
    return WikitextWindows(tokens, seq_length, stride, tokenizer.eod, num_original)


@dataclass
class LambadaExamples:
    """(context ids, target ids) of each passage, padded to seq_length + 1 on access."""

    examples: List[Tuple[List[int], List[int]]]
    seq_length: int
    pad_id: int

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def num_truncated(self) -> int:
        """Passages whose context loses tokens on the left to fit the window."""
        return sum(len(c) + len(t) > self.seq_length + 1 for c, t in self.examples)

    def __getitem__(self, idx: int) -> Tuple[np.ndarray, np.ndarray]:
        context, target = self.examples[idx]
        room = self.seq_length + 1 - len(target)
        context = context[-room:] if room > 0 else []
        return _padded(context + target, [0] * len(context) + [1] * len(target),
                       self.seq_length + 1, self.pad_id)


def split_last_word(text: str, tokenizer, strict: bool) -> Tuple[List[int], List[int]]:
    """Context and target ids: the last whitespace word (strict) or the last BPE token."""
    if not strict:
        ids = tokenizer.tokenize(text)
        return ids[:-1], ids[-1:]
    last_word = text.split()[-1]
    start = text.rfind(last_word)
    return tokenizer.tokenize(text[:start].strip()), tokenizer.tokenize(" " + last_word)


def read_lambada(path: str, tokenizer, seq_length: int, strict: bool,
                 detokenizer: str = "none") -> LambadaExamples:
    """Passages from a JSON-lines file of {"text": ...}, each detokenized first."""
    examples = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                text = detokenize(detokenizer, _passage(line, path, number))
                context, target = split_last_word(text, tokenizer, strict)
                if not target or len(target) > seq_length:
                    raise TaskDataError(f"{path} line {number}: the last word has "
                                        f"{len(target)} tokens; it must have 1..{seq_length}")
                examples.append((context, target))
    except OSError as err:
        raise TaskDataError(f"cannot read --valid-data {path}: {err.strerror}") from None
    if not examples:
        raise TaskDataError(f"{path} holds no passages")
    return LambadaExamples(examples, seq_length, tokenizer.eod)


def _passage(line: str, path: str, number: int) -> str:
    try:
        text = json.loads(line)["text"]
    except (ValueError, KeyError, TypeError):
        raise TaskDataError(f"{path} line {number}: expected a JSON object with a \"text\" "
                            f"field") from None
    if not isinstance(text, str) or not text.split():
        raise TaskDataError(f"{path} line {number}: \"text\" is empty")
    return text
