"""PretrainedFromHF: a local Hugging Face tokenizer directory, through ``transformers``."""
import os
from typing import Dict, List, Sequence

from megatron.tokenizer.abstract import AbstractTokenizer


class PretrainedFromHF(AbstractTokenizer):
    """Wraps ``transformers.AutoTokenizer`` loaded from a local path (no download).

    ``eod`` is the tokenizer's EOS token. ``tokenize`` adds no special tokens:
    preprocessing appends ``eod`` itself (``--append-eod``).
    """

    def __init__(self, name_or_path):
        super().__init__("PretrainedFromHF")
        if name_or_path is None:
            raise ValueError("PretrainedFromHF needs --tokenizer-name-or-path (a local directory)")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ImportError("--tokenizer-type PretrainedFromHF needs the 'transformers' "
                              "package (pip install transformers)") from None
        if not os.path.isdir(name_or_path):
            raise FileNotFoundError(f"--tokenizer-name-or-path: directory not found: {name_or_path}")
        self._tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
        if self._tokenizer.eos_token_id is None:
            raise ValueError(f"--tokenizer-name-or-path {name_or_path}: the tokenizer has no "
                             "EOS token to use as end of document")

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    @property
    def vocab(self) -> Dict[str, int]:
        return self._tokenizer.get_vocab()

    @property
    def eod(self) -> int:
        return self._tokenizer.eos_token_id

    def tokenize(self, text: str) -> List[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids))
