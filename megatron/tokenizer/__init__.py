"""Tokenizers: ``build_tokenizer`` picks one by its ``--tokenizer-type`` name."""
from typing import Optional

from megatron.tokenizer.abstract import AbstractTokenizer
from megatron.tokenizer.fairseq_dict import FairseqGPT2BPETokenizer
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.tokenizer.hf import PretrainedFromHF
from megatron.tokenizer.sentencepiece import (GPTSentencePieceTokenizer, Llama2Tokenizer,
                                               SentencePieceTokenizer)
from megatron.tokenizer.simple import ByteLevelTokenizer, NullTokenizer
from megatron.tokenizer.tiktoken_bpe import Llama3Tokenizer

TOKENIZER_TYPES = ("GPT2BPETokenizer", "PretrainedFromHF", "HuggingFaceTokenizer",
                   "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                   "Llama3Tokenizer", "NullTokenizer", "ByteLevelTokenizer", "FairseqGPT2BPETokenizer")
# --tokenizer-model FILE (or DIR for HuggingFaceTokenizer), as in Megatron-LM
_MODEL_FILE_TOKENIZERS = {"SentencePieceTokenizer": SentencePieceTokenizer,
                          "GPTSentencePieceTokenizer": GPTSentencePieceTokenizer,
                          "Llama2Tokenizer": Llama2Tokenizer, "Llama3Tokenizer": Llama3Tokenizer}

__all__ = ["AbstractTokenizer", "GPT2BPETokenizer", "PretrainedFromHF", "NullTokenizer",
           "ByteLevelTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
           "Llama2Tokenizer", "Llama3Tokenizer", "TOKENIZER_TYPES", "build_tokenizer", "padded_vocab_size"]


def build_tokenizer(tokenizer_type: str, vocab_file=None, merge_file=None,
                    tokenizer_name_or_path=None, vocab_size=None,
                    tokenizer_model=None) -> AbstractTokenizer:
    """Build the tokenizer named by ``tokenizer_type`` (Megatron-LM's and Megatron-DeepSpeed's
    flag values). HuggingFaceTokenizer is Megatron-LM's name for PretrainedFromHF (its local
    directory in --tokenizer-model or --tokenizer-name-or-path)."""
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "FairseqGPT2BPETokenizer":  # --tokenizer-model: the fairseq dict.txt
        return FairseqGPT2BPETokenizer(vocab_file, merge_file, tokenizer_model)
    if tokenizer_type in ("PretrainedFromHF", "HuggingFaceTokenizer"):
        return PretrainedFromHF(tokenizer_name_or_path or tokenizer_model)
    if tokenizer_type in _MODEL_FILE_TOKENIZERS:
        return _MODEL_FILE_TOKENIZERS[tokenizer_type](tokenizer_model)
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
