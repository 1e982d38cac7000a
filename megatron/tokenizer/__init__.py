"""Tokenizers: ``build_tokenizer`` picks one by its ``--tokenizer-type`` name."""
from typing import Optional

from megatron.tokenizer.abstract import AbstractTokenizer
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.tokenizer.hf import PretrainedFromHF
from megatron.tokenizer.simple import ByteLevelTokenizer, NullTokenizer

TOKENIZER_TYPES = ("GPT2BPETokenizer", "PretrainedFromHF", "NullTokenizer", "ByteLevelTokenizer")

__all__ = ["AbstractTokenizer", "GPT2BPETokenizer", "PretrainedFromHF", "NullTokenizer",
           "ByteLevelTokenizer", "TOKENIZER_TYPES", "build_tokenizer", "padded_vocab_size"]


def build_tokenizer(tokenizer_type: str, vocab_file=None, merge_file=None,
                    tokenizer_name_or_path=None, vocab_size=None) -> AbstractTokenizer:
    """Build the tokenizer named by ``tokenizer_type`` (Megatron's flag values)."""
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "PretrainedFromHF":
        return PretrainedFromHF(tokenizer_name_or_path)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if tokenizer_type == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    raise ValueError(f"unknown --tokenizer-type {tokenizer_type!r}; "
                     f"valid types: {', '.join(TOKENIZER_TYPES)}")


def padded_vocab_size(orig_vocab_size: int, make_vocab_size_divisible_by: int,
                      tp_size: int, pad_to: Optional[int] = None) -> int:
    """Smallest multiple of ``make_vocab_size_divisible_by * tp_size`` >= ``orig_vocab_size``,
    or exactly ``pad_to`` (--pad-vocab-size-to) when given.

    The embedding is split over tensor-parallel ranks, so each shard stays a
    multiple of ``make_vocab_size_divisible_by`` (e.g. 50257 -> 50304 at TP 1).
    """
    if pad_to is not None:
        if pad_to < orig_vocab_size or pad_to % tp_size:
            raise ValueError(f"--pad-vocab-size-to {pad_to} must be >= the tokenizer's "
                             f"{orig_vocab_size} ids and divisible by "
                             f"--tensor-model-parallel-size {tp_size}")
        return pad_to
    for name, value in (("vocab size", orig_vocab_size),
                        ("--make-vocab-size-divisible-by", make_vocab_size_divisible_by),
                        ("--tensor-model-parallel-size", tp_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-orig_vocab_size // multiple) * multiple
