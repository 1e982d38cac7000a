"""Undo WikiText's tokenization before BPE, with the rules of Megatron's zero-shot evaluation.

WikiText's `.tokens` files separate punctuation with spaces and write number
separators as ` @-@ `, ` @,@ `, ` @.@ `. Perplexities are only comparable with
published numbers when the same rules, in the same order, rebuild the text.
"""
import re
from typing import Callable, List, Tuple

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


def wikitext_detokenize(text: str) -> str:
    """Apply every rule of `WIKITEXT_RULES` in order."""
    for _, apply in WIKITEXT_RULES:
        text = apply(text)
    return text
