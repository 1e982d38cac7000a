"""Tokenizers that need no vocabulary files: NullTokenizer and ByteLevelTokenizer."""
from typing import Dict, List, Sequence

from megatron.tokenizer.abstract import AbstractTokenizer
from megatron.tokenizer.gpt2_bpe import EOD_TOKEN, bytes_to_unicode


class NullTokenizer(AbstractTokenizer):
    """Text is already token ids, written as whitespace-separated integers.

    Megatron's semantics: built with ``vocab_size`` N, ids are 0..N-1, ``eod`` is N,
    so ``vocab_size`` reports N + 1.
    """

    def __init__(self, vocab_size):
        super().__init__("NullTokenizer")
        if vocab_size is None or int(vocab_size) <= 0:
            raise ValueError(f"NullTokenizer needs --vocab-size > 0, got {vocab_size!r}")
        self._eod = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._eod + 1

    @property
    def vocab(self) -> Dict[str, int]:
        return {str(i): i for i in range(self._eod + 1)}

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> List[int]:
        ids = []
        for word in text.split():
            try:
                idx = int(word)
            except ValueError:
                raise ValueError(f"NullTokenizer: {word!r} is not an integer token id; "
                                 "its input text must be space-separated ids") from None
            if not 0 <= idx <= self._eod:
                raise ValueError(f"NullTokenizer: id {idx} is outside 0..{self._eod} "
                                 f"(--vocab-size {self._eod})")
            ids.append(idx)
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class ByteLevelTokenizer(AbstractTokenizer):
    """UTF-8 bytes as ids 0..255; ``eod`` is 256. Needs no files."""

    def __init__(self):
        super().__init__("ByteLevelTokenizer")

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def vocab(self) -> Dict[str, int]:
        vocab = {ch: b for b, ch in bytes_to_unicode().items()}
        vocab[EOD_TOKEN] = 256
        return vocab

    @property
    def eod(self) -> int:
        return 256

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
