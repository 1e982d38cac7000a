"""The interface every tokenizer of the framework implements."""
from abc import ABC, abstractmethod
from typing import Dict, List, Sequence


class AbstractTokenizer(ABC):
    """Text <-> token ids, with an end-of-document id (``eod``).

    ``vocab_size`` is the number of real ids (not padded for tensor parallelism);
    every id a tokenizer emits is in ``range(vocab_size)``.
    """

    def __init__(self, name: str):
        self.name = name

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, unpadded."""

    @property
    @abstractmethod
    def vocab(self) -> Dict[str, int]:
        """Token string -> id."""

    @property
    def inv_vocab(self) -> Dict[int, str]:
        """Id -> token string (built on first use)."""
        inverse = getattr(self, "_inv_vocab_cache", None)
        if inverse is None:
            inverse = {idx: token for token, idx in self.vocab.items()}
            self._inv_vocab_cache = inverse
        return inverse

    @abstractmethod
    def tokenize(self, text: str) -> List[int]:
        """Encode ``text`` to ids."""

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Decode ids back to text."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """The id that ends a document."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"
