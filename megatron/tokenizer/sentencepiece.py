"""SentencePiece tokenizers under Megatron-LM's names (--tokenizer-type ... --tokenizer-model FILE).

- SentencePieceTokenizer: the model's pieces, then Megatron's special tokens <CLS> <SEP> <EOD>
  <MASK> (and pad/bos/eos when the model has none) appended as new ids; `eod` is <EOD>;
  special tokens written in the text are kept whole.
- GPTSentencePieceTokenizer: the model's pieces only; `eod` is the model's EOS.
- Llama2Tokenizer: the model's pieces; every text starts with BOS; `eod` is EOS.
Needs the `sentencepiece` package (pip install sentencepiece); reads local files only.
"""
import os
import re
from typing import Dict, List, Sequence

from megatron.tokenizer.abstract import AbstractTokenizer


def load_sentencepiece(model_file):
    if model_file is None:
        raise ValueError("SentencePiece tokenizers need --tokenizer-model (a .model file)")
    if not os.path.isfile(model_file):
        raise FileNotFoundError(f"--tokenizer-model: file not found: {model_file}")
    try:
        import sentencepiece
    except ImportError:
        raise ImportError("SentencePiece tokenizers need the 'sentencepiece' package "
                          "(pip install sentencepiece)") from None
    return sentencepiece.SentencePieceProcessor(model_file=model_file)


class _SentencePieceBase(AbstractTokenizer):
    def __init__(self, name: str, model_file):
        super().__init__(name)
        self._sp = load_sentencepiece(model_file)
        self._vocab = {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())}

    def _piece(self, index: int, default: str) -> str:
        return self._sp.id_to_piece(index) if 0 <= index < self._sp.get_piece_size() else default

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    def tokenize(self, text: str) -> List[int]:
        return self._sp.encode_as_ids(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode_ids([int(i) for i in ids])

    @property
    def eod(self) -> int:
        return self._sp.eos_id()


class GPTSentencePieceTokenizer(_SentencePieceBase):
    def __init__(self, model_file):
        super().__init__("GPTSentencePieceTokenizer", model_file)
        if self._sp.eos_id() < 0:
            raise ValueError(f"--tokenizer-model {model_file} has no EOS piece to end documents")


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    def __init__(self, model_file):
        super().__init__(model_file)
        self.name = "Llama2Tokenizer"

    def tokenize(self, text: str) -> List[int]:
        return [self._sp.bos_id()] + self._sp.encode_as_ids(text)


class SentencePieceTokenizer(_SentencePieceBase):
    def __init__(self, model_file):
        super().__init__("SentencePieceTokenizer", model_file)
        self._special: Dict[str, int] = {}
        for token in ("<CLS>", "<SEP>", "<EOD>", "<MASK>",
                      self._piece(self._sp.pad_id(), "<PAD>"),
                      self._piece(self._sp.bos_id(), "<BOS>"),
                      self._piece(self._sp.eos_id(), "<EOS>")):
            self._special[token] = self._vocab.setdefault(token, len(self._vocab))
        self._inverse_special = {i: t for t, i in self._special.items()}
        self._split = re.compile("(" + "|".join(
            re.escape(t) for t in sorted(self._special, key=len, reverse=True)) + ")")

    @property
    def eod(self) -> int:
        return self._special["<EOD>"]

    def tokenize(self, text: str) -> List[int]:
        ids: List[int] = []
        for i, part in enumerate(self._split.split(text)):
            if i % 2:
                ids.append(self._special[part])
            elif part:
                ids.extend(self._sp.encode_as_ids(part))
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        text, run = "", []
        for index in (int(i) for i in ids):
            if index in self._inverse_special:
                text += self._sp.decode_ids(run) + self._inverse_special[index]
                run = []
            else:
                run.append(index)
        return text + self._sp.decode_ids(run)
