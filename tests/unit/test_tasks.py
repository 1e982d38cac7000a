"""Zero-shot tasks: WikiText detokenizer and windows, LAMBADA targets, scoring, tasks/main.py."""
import json
import math
import re

import pytest
import torch

from megatron.config import CheckpointConfig, Config, DataConfig, ModelConfig
from megatron.model import GPTModel
from megatron.mpu import model_parallel_seed, single_process_state
from megatron.tokenizer import ByteLevelTokenizer
from megatron.checkpointing import api
from megatron.checkpointing.formats import RunState
from tasks import main as tasks_main
from tasks.zeroshot_gpt.datasets import (LambadaExamples, TaskDataError, WikitextWindows,
                                         read_lambada, split_last_word)
from tasks.zeroshot_gpt.detokenizer import wikitext_detokenize
from tasks.zeroshot_gpt.evaluate import (format_metrics, micro_batches, num_micro_batches,
                                         score, wikitext_metrics)
from tests.data_setup import reference_file

SEQ = 16


# -- detokenizer ---------------------------------------------------------------------
@pytest.mark.parametrize("raw, text", [
    ("a 1 @,@ 000 @.@ 5 km @-@ long", "a 1,000.5 km-long"),
    ("word , word . Next ; and : so ! what ? ok", "word, word. Next; and: so! what? ok"),
    ("f ( x y ) [ a ] { b } \" q \"", "f (x y) [a] {b} \"q\""),
    (" = = = Heading = = = \n", " === Heading ===\n"),
    ("the dogs ' bones", "the dogs' bones"),
    ("John 's car", "John's car"),
    ("10 \u00b0 C and N people", "10\u00b0C and 1 people"),
])
def test_wikitext_detokenizer_rules(raw, text):
    assert wikitext_detokenize(raw) == text


def test_wikitext_test_split_counts():
    path = reference_file("wikitext", "wiki.test.tokens")
    raw = path.read_bytes().decode("utf-8")
    assert len(raw.strip().split(" ")) == 245566
    text = wikitext_detokenize(raw)
    assert " @-@ " not in text and " @,@ " not in text and " , " not in text
    assert len(text) < len(raw)


# -- WikiText windows --------------------------------------------------------------------
@pytest.mark.parametrize("n, seq, stride", [(100, 16, 16), (100, 16, 4), (101, 16, 1),
                                            (10, 16, 8), (17, 16, 16), (18, 16, 5)])
def test_windows_score_every_label_once(n, seq, stride):
    windows = WikitextWindows(list(range(n)), seq, stride, pad_id=-1, num_original_tokens=n)
    counts = torch.zeros(n, dtype=torch.long)
    for idx in range(len(windows)):
        tokens, mask = windows[idx]
        assert tokens.shape == (seq + 1,) and mask.shape == (seq,)
        labels = torch.from_numpy(tokens[1:])
        scored = labels[torch.from_numpy(mask) > 0]
        assert (scored >= 0).all()  # never a pad
        counts[scored] += 1
        if idx > 0 and stride < seq:
            assert mask[:seq - stride].sum() == 0  # the overlap is context only
    assert counts[0] == 0 and bool((counts[1:] == 1).all())


def test_windows_reject_bad_stride():
    with pytest.raises(TaskDataError, match="--overlapping-eval"):
        WikitextWindows(list(range(50)), 16, 17, 0, 50)


# -- LAMBADA -------------------------------------------------------------------------
def test_lambada_targets():
    tok = ByteLevelTokenizer()
    context, target = split_last_word("He said hello  there\n", tok, strict=True)
    assert bytes(context).decode() == "He said hello" and bytes(target).decode() == " there"
    context, target = split_last_word("ab cd", tok, strict=False)
    assert bytes(context).decode() == "ab c" and bytes(target).decode() == "d"
    examples = LambadaExamples([(list(range(1, 30)), [40, 41])], seq_length=SEQ, pad_id=0)
    tokens, mask = examples[0]
    assert tokens.tolist()[-2:] == [40, 41] and tokens[0] == 29 - (SEQ + 1 - 2) + 1  # left-cut
    assert mask.tolist() == [0.0] * (SEQ - 2) + [1.0, 1.0]
    short = LambadaExamples([([5, 6], [7])], seq_length=SEQ, pad_id=0)
    tokens, mask = short[0]
    assert tokens.tolist()[:4] == [5, 6, 7, 0] and mask.tolist()[:3] == [0.0, 1.0, 0.0]


def test_lambada_bad_lines(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine words"}\n{"txt": 1}\n')
    with pytest.raises(TaskDataError, match="line 2"):
        read_lambada(str(path), ByteLevelTokenizer(), SEQ, strict=True)


def test_lambada_score_counts_exact_predictions_of_valid_samples():
    labels = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [4, 4, 4]])
    logits = torch.nn.functional.one_hot(torch.tensor([[1, 2, 3], [1, 0, 3], [9, 2, 3],
                                                       [4, 4, 4]]), 10).float()
    batch = {"labels": labels, "loss_mask": torch.tensor([[0, 1, 1.0]] * 4),
             "valid": torch.tensor([1.0, 1.0, 1.0, 0.0])}
    total, report = score("LAMBADA", batch, logits)
    assert total.item() == 2.0 and report["score"].item() == 2.0  # row 1 wrong, row 3 padding


# -- batching and metrics -------------------------------------------------------------
def test_micro_batches_cover_every_sample_once_over_dp():
    data = [(torch.full((SEQ + 1,), i).numpy(), torch.ones(SEQ).numpy()) for i in range(11)]
    seen = []
    for dp_rank in range(3):
        count = num_micro_batches(len(data), 2, 3, multiple=2)
        assert count % 2 == 0
        for batch in micro_batches(data, count, 2, dp_rank, 3, eod=99, device="cpu",
                                   data_cfg=DataConfig()):
            for row, valid in zip(batch["tokens"], batch["valid"]):
                if valid:
                    seen.append(int(row[0]))
                else:
                    assert bool((row == 99).all())
    assert sorted(seen) == list(range(11))


def test_wikitext_metrics_and_line():
    metrics = wikitext_metrics(total_loss=2.0 * 99, num_tokenized=100, num_original=51)
    assert metrics["avg loss"] == 2.0 and metrics["token ratio"] == 99 / 50
    assert math.isclose(metrics["adjusted ppl"], math.exp(2.0 * 99 / 50))
    line = format_metrics("WIKITEXT103", metrics)
    assert re.fullmatch(r" validation results on WIKITEXT103 \| avg loss: \S+ \| ppl: \S+ \| "
                        r"adjusted ppl: \S+ \| token ratio: \S+ \|", line)
    assert line.startswith(" validation results on WIKITEXT103 | avg loss: 2.0000E+00 | "
                           "ppl: 7.3891E+00 |")


# -- tasks/main.py end to end -----------------------------------------------------------
def _config() -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ,
                       max_position_embeddings=64, padded_vocab_size=384, hidden_dropout=0.0,
                       attention_dropout=0.0, layer_norm_fusion=False, masked_softmax_fusion=False)


@pytest.fixture
def checkpoint(tmp_path):
    model_parallel_seed(1234, 0)
    model = GPTModel(_config())
    model.init_weights(11)
    config = Config(model=_config(), data=DataConfig(tokenizer_type="ByteLevelTokenizer"),
                    checkpoint=CheckpointConfig(no_save_optim=True, no_save_rng=True))
    root = tmp_path / "ckpt"
    api.save(str(root), 3, RunState([model], config, single_process_state()))
    model.vocab_limit = ByteLevelTokenizer().vocab_size  # as the evaluation loads it
    return str(root), model.eval()


def _losses(model, ids):
    tokens = torch.tensor([ids[:-1]])
    positions = torch.arange(len(ids) - 1).unsqueeze(0)
    with torch.no_grad():
        return model(tokens, positions, labels=torch.tensor([ids[1:]]))[0]


def test_wikitext_main_matches_direct_losses(checkpoint, tmp_path, capsys):
    root, model = checkpoint
    raw = " = Title = \n The cat sat on the mat , and the dog @-@ like fox ran . \n" * 3
    (tmp_path / "wiki.tokens").write_text(raw)
    ids = ByteLevelTokenizer().tokenize(wikitext_detokenize(raw))
    # stride = window: consecutive chunks of the stream
    expected = sum(float(_losses(model, ids[s:s + SEQ + 1]).sum())
                   for s in range(0, len(ids) - 1, SEQ))
    base = ["--load", root, "--task", "WIKITEXT103", "--valid-data", str(tmp_path / "wiki.tokens")]
    metrics = tasks_main.main(base + ["--overlapping-eval", str(SEQ), "--micro-batch-size", "3"])
    assert math.isclose(metrics["avg loss"] * (len(ids) - 1), expected, rel_tol=1e-5)
    assert metrics["token ratio"] == (len(ids) - 1) / (len(raw.strip().split(" ")) - 1)
    assert " avg loss: " in capsys.readouterr().out
    # stride 4: after the first window, each window scores its last 4 labels (those that exist)
    expected = float(_losses(model, ids[:SEQ + 1]).sum())
    start = 4
    while start + SEQ - 4 < len(ids) - 1:
        expected += float(_losses(model, ids[start:start + SEQ + 1])[SEQ - 4:].sum())
        start += 4
    metrics = tasks_main.main(base + ["--overlapping-eval", "4"])
    assert math.isclose(metrics["avg loss"] * (len(ids) - 1), expected, rel_tol=1e-5)


def test_lambada_main_matches_direct_greedy(checkpoint, tmp_path):
    root, model = checkpoint
    tok = ByteLevelTokenizer()
    texts = ["the cat sat on the mat", "aaaa aaaa aaaa aaaa", "zzzz zzzz", "ab ab ab ab ab"]
    path = tmp_path / "lambada.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    for strict in (True, False):
        correct = 0
        for text in texts:
            context, target = split_last_word(text, tok, strict)
            ids = (context + target)[-(SEQ + 1):]  # long passages keep their last SEQ+1 tokens
            with torch.no_grad():
                logits = model(torch.tensor([ids[:-1]]),
                               torch.arange(len(ids) - 1).unsqueeze(0))[0]
            correct += logits.argmax(-1)[-len(target):].tolist() == target
        argv = ["--load", root, "--task", "LAMBADA", "--valid-data", str(path),
                "--micro-batch-size", "3"] + (["--strict-lambada"] if strict else [])
        metrics = tasks_main.main(argv)
        assert metrics["number correct"] == correct and metrics["total examples"] == 4


@pytest.mark.parametrize("extra, message", [
    ([], "--valid-data is required"),
    (["--valid-data", "x", "--overlapping-eval", "0"], "--overlapping-eval (0)"),
])
def test_main_flag_errors(checkpoint, capsys, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        tasks_main.main(["--load", checkpoint[0], "--task", "WIKITEXT103"] + extra)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_main_missing_data_file(checkpoint, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tasks_main.main(["--load", checkpoint[0], "--task", "LAMBADA", "--valid-data",
                         str(tmp_path / "missing.jsonl")])
    assert exit_info.value.code == 2 and "cannot read --valid-data" in capsys.readouterr().err


def test_padding_rows_never_count_in_inference_losses(checkpoint):
    """With vocab_limit (as every inference entry point loads models), padding ids get -inf
    logits and the loss is the cross entropy over the tokenizer's vocabulary alone."""
    _, model = checkpoint
    limit = model.vocab_limit
    assert limit < model.cfg.padded_vocab_size  # the fixture's vocabulary is padded
    ids = ByteLevelTokenizer().tokenize("padding rows never win")
    tokens, labels = torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])
    positions = torch.arange(len(ids) - 1).unsqueeze(0)
    with torch.no_grad():
        logits = model(tokens, positions)
        model.vocab_limit = None
        try:
            raw = model(tokens, positions)
        finally:
            model.vocab_limit = limit
        losses = model(tokens, positions, labels=labels)
    assert torch.isinf(logits[..., limit:]).all() and torch.equal(logits[..., :limit], raw[..., :limit])
    expected = torch.nn.functional.cross_entropy(raw[0, :, :limit].float(), labels[0], reduction="none")
    torch.testing.assert_close(losses[0], expected, rtol=1e-5, atol=1e-6)
