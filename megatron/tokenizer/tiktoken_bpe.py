"""Llama3Tokenizer: a tiktoken BPE file (Llama 3's tokenizer.model) read from a local path.

The file holds one `base64(token bytes) rank` per line. Llama 3's 256 special tokens follow
the ranks (<|begin_of_text|>, <|end_of_text|>, ...); every text starts with
<|begin_of_text|>, `eod` is <|end_of_text|>. Needs the `tiktoken` package; nothing is
downloaded (the ranks are parsed here, not through tiktoken's URL cache).
"""
import base64
import os
from typing import Dict, List, Sequence

from megatron.tokenizer.abstract import AbstractTokenizer

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
NUM_SPECIAL = 256


def llama3_special_tokens() -> List[str]:
    named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
             "<|reserved_special_token_1|>", "<|reserved_special_token_2|>",
             "<|reserved_special_token_3|>", "<|start_header_id|>", "<|end_header_id|>",
             "<|reserved_special_token_4|>", "<|eot_id|>"]
    return named + [f"<|reserved_special_token_{i}|>" for i in range(5, NUM_SPECIAL - 5)]


def read_bpe_ranks(path) -> Dict[bytes, int]:
    if path is None:
        raise ValueError("Llama3Tokenizer needs --tokenizer-model (a tiktoken BPE file)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--tokenizer-model: file not found: {path}")
    ranks = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
                except ValueError:
                    raise ValueError(f"--tokenizer-model {path}:{number}: expected "
                                     f"'base64-token rank'") from None
    return ranks


class Llama3Tokenizer(AbstractTokenizer):
    def __init__(self, model_file):
        super().__init__("Llama3Tokenizer")
        ranks = read_bpe_ranks(model_file)
        try:
            import tiktoken
        except ImportError:
            raise ImportError("Llama3Tokenizer needs the 'tiktoken' package "
                              "(pip install tiktoken)") from None
        base = len(ranks)
        self._special = {t: base + i for i, t in enumerate(llama3_special_tokens())}
        self._encoding = tiktoken.Encoding(name=os.path.basename(model_file),
                                           pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                           special_tokens=self._special)
        self._vocab = {t.decode("utf-8", errors="replace"): i for t, i in ranks.items()}
        self._vocab.update(self._special)

    @property
    def vocab_size(self) -> int:
        return self._encoding.n_vocab

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def eod(self) -> int:
        return self._special["<|end_of_text|>"]

    def tokenize(self, text: str) -> List[int]:
        return [self._special["<|begin_of_text|>"]] + self._encoding.encode(
            text, allowed_special=set(), disallowed_special=())

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._encoding.decode([int(i) for i in ids])
