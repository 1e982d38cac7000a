"""Undo a corpus' word tokenization before BPE, with the rules of Megatron's zero-shot evaluation.

WikiText's `.tokens` files separate punctuation with spaces and write number
separators as ` @-@ `, ` @,@ `, ` @.@ `; the Penn Treebank files split
contractions (` n't`, ` 's`) and write numbers as `N`. Perplexities are only
comparable with published numbers when the same rules, in the same order,
rebuild the text. As in Megatron, the detokenizer is picked from the data
file's path (`ptb`, then `wiki`, then `lambada`); `--detokenizer` forces one.
`fairseq` is fairseq's Megatron-11b detokeniser (tasks/fairseq_lm/detok.py, needs sacremoses).
"""
import re
from typing import Callable, Dict, List, Optional, Tuple

_Rule = Tuple[str, Callable[[str], str]]


def _literal(old: str, new: str) -> _Rule:
    return f"{old!r} -> {new!r}", lambda s: s.replace(old, new)


def _pattern(regex: str, replacement: str) -> _Rule:
    compiled = re.compile(regex)
    return f"/{regex}/ -> {replacement!r}", lambda s: compiled.sub(replacement, s)


def _enclosed(open_char: str, close_char: str) -> _Rule:
    """Drop the spaces just inside a pair of brackets or quotes: "( a b )" -> "(a b)"."""
    o, c = re.escape(open_char), re.escape(close_char)
    return _pattern(f"{o}\\s*([^{c}]*?)\\s*{c}", f"{open_char}\\1{close_char}")


WIKITEXT_RULES: List[_Rule] = [
    # possessive of plurals
    _literal("s '", "s'"),
    # kept as Megatron has it: a pattern with literal slashes, which almost never matches
    _pattern(r"/' [0-9]/", r"/'[0-9]/"),
    # number separators
    _literal(" @-@ ", "-"),
    _literal(" @,@ ", ","),
    _literal(" @.@ ", "."),
    # punctuation followed by a space
    *[_literal(f" {p} ", f"{p} ") for p in (":", ";", ".", "!", "?", ",")],
    # spaces inside brackets and quotes
    _enclosed("(", ")"),
    _enclosed("[", "]"),
    _enclosed("{", "}"),
    _enclosed('"', '"'),
    _enclosed("'", "'"),
    # section headings, degrees, line ends, numbers, possessives
    _literal("= = = =", "===="),
    _literal("= = =", "==="),
    _literal("= =", "=="),
    _literal(" \u00b0 ", "\u00b0"),
    _literal(" \n", "\n"),
    _literal("\n ", "\n"),
    _literal(" N ", " 1 "),
    _literal(" 's", "'s"),
]


PTB_RULES: List[_Rule] = [
    _literal(" '", "'"),
    _literal(" \n", "\n"),
    _literal("\n ", "\n"),
    _literal(" n't", "n't"),
    _literal(" N ", "1 "),
    _literal("$ 1", "$1"),
    _literal("# 1", "#1"),
]

LAMBADA_RULES: List[_Rule] = [
    # typographic double quotes become plain ones; the passage loses outer whitespace
    _literal("\u201c", '"'),
    _literal("\u201d", '"'),
    ("strip", str.strip),
]

def _fairseq(text: str) -> str:
    from tasks.fairseq_lm.detok import fairseq_detokenize  # sacremoses is optional
    return fairseq_detokenize(text)


RULES: Dict[str, List[_Rule]] = {"ptb": PTB_RULES, "wikitext": WIKITEXT_RULES,
                                 "lambada": LAMBADA_RULES,
                                 "fairseq": [("Moses per line, then fairseq's @ and = fixes",
                                              _fairseq)],
                                 "none": []}
DETOKENIZERS = tuple(RULES)
# the path keys Megatron looks for, in its order, and the detokenizer each selects
_PATH_KEYS = (("ptb", "ptb"), ("wiki", "wikitext"), ("lambada", "lambada"))


def detokenize(name: str, text: str) -> str:
    """Apply every rule of detokenizer `name` (one of DETOKENIZERS) in order."""
    for _, apply in RULES[name]:
        text = apply(text)
    return text


def wikitext_detokenize(text: str) -> str:
    return detokenize("wikitext", text)


def detokenizer_for_path(path: str) -> Optional[str]:
    """The detokenizer Megatron picks for a data file: the first key found in its path."""
    for key, name in _PATH_KEYS:
        if key in path:
            return name
    return None
