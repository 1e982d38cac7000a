"""tasks/main.py talks like Megatron: progress, data set lines, result lines, flags, JSON."""
import json
import math
import re

import pytest
import torch

from megatron.tokenizer import ByteLevelTokenizer
from tasks import main as tasks_main
from tasks.zeroshot_gpt.datasets import read_lambada
from tasks.zeroshot_gpt.detokenizer import detokenize, detokenizer_for_path
from tasks.zeroshot_gpt.evaluate import score
from tests.unit.test_tasks import SEQ, checkpoint  # noqa: F401  (the fixture)

# what a Megatron user's log parser matches
NUMBER = r"([-+0-9.]+(?:E[-+]\d+)?)"
WIKI_LINE = re.compile(r"^ validation results on WIKITEXT103 \| avg loss: " + NUMBER
                       + r" \| ppl: " + NUMBER + r" \| adjusted ppl: " + NUMBER
                       + r" \| token ratio: " + NUMBER + r" \|$", re.M)
LAMBADA_LINE = re.compile(r"^ validation results on LAMBADA \| number correct: " + NUMBER
                          + r" \| total examples: " + NUMBER + r" \| avg accuracy: " + NUMBER
                          + r"$", re.M)
TOKENS_LINE = re.compile(r"> number of original tokens: (\d+), number of detokenized tokens: "
                         r"(\d+)")
FOUND_LINE = re.compile(r"> found (\d+) samples\.")
PROGRESS = re.compile(r"^ > evaluated batches: (\d+)/(\d+) \| tokens per second: " + NUMBER
                      + r" \| running avg (?:loss|accuracy): " + NUMBER + r" \|$", re.M)
WIKI_RAW = " = Title = \n The cat sat on the mat , and the dog @-@ like fox ran . \n" * 3


def _rules_around(out: str, line_re) -> None:
    """The result line sits between dashed rules one character longer, as in Megatron."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line_re.match(line))
    assert lines[at - 1] == lines[at + 1] == "-" * (len(lines[at]) + 1)


def test_wikitext_output_parses_like_megatron(checkpoint, tmp_path, capsys):
    root, _ = checkpoint
    data = tmp_path / "wiki.test.tokens"
    data.write_text(WIKI_RAW)
    results = tmp_path / "out" / "wiki.json"
    metrics = tasks_main.main(["--load", root, "--task", "WIKITEXT103", "--valid-data", str(data),
                               "--batch-size", "1", "--overlapping-eval", "8",
                               "--log-interval", "2", "--results-json", str(results)])
    out = capsys.readouterr().out
    loss, ppl, adjusted, ratio = (float(v) for v in WIKI_LINE.search(out).groups())
    assert loss == float(f"{metrics['avg loss']:.4E}") and ratio == metrics["token ratio"]
    assert ppl == float(f"{metrics['ppl']:.4E}")
    assert adjusted == float(f"{metrics['adjusted ppl']:.4E}")
    _rules_around(out, WIKI_LINE)
    original, detokenized = (int(v) for v in TOKENS_LINE.search(out).groups())
    assert original == len(WIKI_RAW.strip().split(" "))
    ids = ByteLevelTokenizer().tokenize(detokenize("wikitext", WIKI_RAW))
    assert detokenized == len(ids)
    batches = math.ceil((len(ids) - 1 - 8) / 8) + 1  # --batch-size 1: one window per batch
    progress = [(int(d), int(t)) for d, t, _, _ in PROGRESS.findall(out)]
    assert batches > 2 and progress == [(d, batches) for d in range(2, batches + 1, 2)]
    assert out.rstrip().endswith("done :-)")
    saved = json.loads(results.read_text())
    assert saved["task"] == "WIKITEXT103" and saved["avg loss"] == metrics["avg loss"]
    assert saved["num tokenized tokens"] == len(ids)


def test_lambada_output_truncation_and_json(checkpoint, tmp_path, capsys):
    root, _ = checkpoint
    texts = ["a cat sat", "x" * (3 * SEQ) + " tail", "zzzz zzzz"]
    data = tmp_path / "lambada_test.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    results = tmp_path / "lambada.json"
    metrics = tasks_main.main(["--load", root, "--task", "LAMBADA", "--valid-data", str(data),
                               "--strict-lambada", "--batch-size", "2", "--log-interval", "1",
                               "--results-json", str(results)])
    out = capsys.readouterr().out
    correct, total, accuracy = (float(v) for v in LAMBADA_LINE.search(out).groups())
    assert total == 3 and correct == metrics["number correct"]
    assert accuracy == float(f"{metrics['avg accuracy']:.4E}")
    _rules_around(out, LAMBADA_LINE)
    assert FOUND_LINE.search(out).group(1) == "3"
    assert " > 1 of 3 contexts truncated from the left (longer than --seq-length 16)" in out
    assert len(PROGRESS.findall(out)) == 2 and out.rstrip().endswith("done :-)")
    saved = json.loads(results.read_text())
    assert saved["avg accuracy"] == metrics["avg accuracy"] and saved["num truncated contexts"] == 1


def test_lambada_argmax_skips_vocabulary_padding():
    labels = torch.tensor([[0, 5]])
    logits = torch.zeros(1, 2, 10)
    logits[0, 1, 5] = 1.0
    logits[0, 1, 8] = 2.0  # a padding id (>= vocab size 6) outscores the target
    batch = {"labels": labels, "loss_mask": torch.tensor([[0.0, 1.0]]),
             "valid": torch.tensor([1.0]), "tokens": labels}
    assert score("LAMBADA", batch, logits)[0].item() == 0.0
    assert score("LAMBADA", batch, logits, vocab_size=6)[0].item() == 1.0


@pytest.mark.parametrize("path, name", [
    ("/d/ptb.test.txt", "ptb"), ("wiki.test.tokens", "wikitext"), ("/wikitext/ptb.txt", "ptb"),
    ("lambada_test.jsonl", "lambada"), ("test.txt", None)])
def test_detokenizer_from_path(path, name):
    assert detokenizer_for_path(path) == name


def test_ptb_and_lambada_detokenizers(tmp_path):
    assert detokenize("ptb", "it 's a do n't \n pay $ 1 or # 1 , x") == \
        "it's a don't\npay $1 or #1 , x"
    assert detokenize("ptb", " a N b") == " a1 b"
    assert detokenize("lambada", "  \u201chi\u201d, he said \n") == '"hi", he said'
    assert detokenize("none", " a @-@ b ") == " a @-@ b "
    data = tmp_path / "l.jsonl"
    data.write_text(json.dumps({"text": "\u201cyes\u201d said \u201cbob\u201d  "}) + "\n")
    forced = read_lambada(str(data), ByteLevelTokenizer(), SEQ, True, "lambada")
    assert bytes(forced.examples[0][1]).decode() == ' "bob"'


def test_forced_detokenizer_changes_wikitext_counts(checkpoint, tmp_path, capsys):
    root, _ = checkpoint
    data = tmp_path / "plain.txt"  # no ptb/wiki/lambada in the name: no detokenizing
    data.write_text(WIKI_RAW)
    base = ["--load", root, "--task", "WIKITEXT103", "--valid-data", str(data),
            "--overlapping-eval", str(SEQ)]
    tasks_main.main(base)
    plain = int(TOKENS_LINE.search(capsys.readouterr().out).group(2))
    tasks_main.main(base + ["--detokenizer", "wikitext"])
    forced = int(TOKENS_LINE.search(capsys.readouterr().out).group(2))
    assert plain == len(WIKI_RAW) and forced == len(detokenize("wikitext", WIKI_RAW))


def test_more_than_one_valid_data_is_an_error(checkpoint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tasks_main.main(["--load", checkpoint[0], "--task", "LAMBADA", "--valid-data", "a", "b"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert "--valid-data takes exactly one file, got 2" in err
