"""fairseq's dictionary (dict.txt) over GPT-2 BPE, as fairseq-preprocess uses it.

A fairseq dictionary holds `<s>`, `<pad>`, `</s>`, `<unk>` (ids 0-3), then one
symbol per line of dict.txt (`<symbol> <count>`, optionally followed by
`#fairseq:overwrite`), in the file's order (frequency order), ending with
`madeupwordNNNN` padding. For GPT-2 BPE models each symbol is a GPT-2 token id
written as a decimal string. `FairseqGPT2BPETokenizer` encodes text with the
GPT-2 BPE files and maps every GPT-2 id to its dictionary id (`<unk>` when the
dictionary lacks it), so its ids are the rows of a fairseq model's embedding.
"""
from typing import Dict, List, Optional, Sequence

from megatron.tokenizer.abstract import AbstractTokenizer
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer

SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
BOS, PAD, EOS, UNK = range(4)
OVERWRITE = "#fairseq:overwrite"


class DictionaryError(ValueError):
    """A dict.txt that fairseq would not read as we do; the message names file and line."""


def _parse_line(path: str, number: int, line: str):
    fields = line.rstrip("\n").rsplit(" ", 2)
    overwrite = len(fields) == 3 and fields[2] == OVERWRITE
    if not overwrite:
        fields = line.rstrip("\n").rsplit(" ", 1)
    if len(fields) < 2 or not fields[0] or not fields[-1 - overwrite].lstrip("-").isdigit():
        raise DictionaryError(f"{path} line {number}: {line.strip()[:40]!r} is not "
                              f"'<symbol> <count>'; this is not a fairseq dict.txt")
    return fields[0], overwrite


def read_dictionary(path: str) -> List[str]:
    """The dictionary's symbols in id order: the 4 specials, then dict.txt's lines."""
    symbols, seen = list(SPECIALS), set(SPECIALS)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as err:
        raise DictionaryError(f"cannot read the fairseq dictionary {path}: {err}") from None
    for number, line in enumerate(lines, start=1):
        symbol, overwrite = _parse_line(path, number, line)
        if symbol in seen and not overwrite:
            raise DictionaryError(f"{path} line {number}: duplicate symbol {symbol!r} (fairseq "
                                  f"accepts it only with {OVERWRITE})")
        seen.add(symbol)
        symbols.append(symbol)
    if len(symbols) == len(SPECIALS):
        raise DictionaryError(f"{path} is empty; a fairseq dict.txt has one symbol per line")
    return symbols


def gpt2_ids(symbols: Sequence[str], path: str = "dict.txt") -> List[Optional[int]]:
    """The GPT-2 id of each dictionary id (None for the specials and madeupword padding)."""
    ids = []
    for index, symbol in enumerate(symbols):
        if index < len(SPECIALS) or symbol.startswith("madeupword"):
            ids.append(None)
        elif symbol.isdigit():
            ids.append(int(symbol))
        else:
            raise DictionaryError(f"{path}: symbol {symbol!r} (id {index}) is not a GPT-2 BPE "
                                  f"id; only dictionaries of GPT-2 BPE models are supported")
    return ids


class FairseqGPT2BPETokenizer(AbstractTokenizer):
    """GPT-2 BPE (--vocab-file, --merge-file) -> fairseq dictionary ids (--tokenizer-model
    dict.txt). The end-of-document id is `</s>` (2), which fairseq appends to every line."""

    def __init__(self, vocab_file: str, merge_file: str, dict_file: str):
        super().__init__("FairseqGPT2BPETokenizer")
        if not dict_file:
            raise ValueError("FairseqGPT2BPETokenizer needs --tokenizer-model DICT (the "
                             "model's fairseq dict.txt)")
        self.bpe = GPT2BPETokenizer(vocab_file, merge_file)
        self.symbols = read_dictionary(dict_file)
        self.gpt2_of = gpt2_ids(self.symbols, dict_file)
        self.index_of = {}
        for index, gpt2 in enumerate(self.gpt2_of):
            if gpt2 is not None:
                self.index_of[gpt2] = index  # the last of repeated symbols, as fairseq's index

    @property
    def vocab_size(self) -> int:
        return len(self.symbols)

    @property
    def vocab(self) -> Dict[str, int]:
        return {symbol: index for index, symbol in enumerate(self.symbols)}

    def tokenize(self, text: str) -> List[int]:
        return [self.index_of.get(i, UNK) for i in self.bpe.tokenize(text)]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.bpe.detokenize([self.gpt2_of[i] for i in ids if self.gpt2_of[i] is not None])

    @property
    def eod(self) -> int:
        return EOS
