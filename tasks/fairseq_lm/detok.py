"""The detokeniser of fairseq's Megatron-11b WikiText-103 evaluation (its examples/megatron_11b
detok.py rules): each line is split on single spaces, Moses-detokenised (sacremoses, English),
then ` @` and `@ ` are dropped (` @-@ ` -> `-`, ` @,@ ` -> `,`, ` @.@ ` -> `.`), the spaces
around `=` removed (`= = Heading = =` -> `==Heading==`) and those around an en dash
(` – ` -> `–`). Lines stay lines."""


class MissingSacremoses(ImportError):
    """sacremoses is not installed; the message says how to install it."""


def moses_detokenizer():
    try:
        from sacremoses import MosesDetokenizer
    except ImportError:
        raise MissingSacremoses("--detokenizer fairseq needs sacremoses (Moses detokenisation): "
                                "pip install sacremoses") from None
    return MosesDetokenizer(lang="en")


def detokenize_line(moses, line: str) -> str:
    text = moses.detokenize(line.strip().split(" "))
    for old, new in ((" @", ""), ("@ ", ""), (" =", "="), ("= ", "="), (" \u2013 ", "\u2013")):
        text = text.replace(old, new)
    return text


def fairseq_detokenize(text: str) -> str:
    """Every line of `text` detokenised as fairseq's detok.py prints it."""
    moses = moses_detokenizer()
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines = lines[:-1]
    return "".join(detokenize_line(moses, line) + "\n" for line in lines)
