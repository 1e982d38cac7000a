"""The fairseq pieces that need no fairseq: dict.txt parsing, eval-lm blocks, metrics,
the sacremoses message, the sinusoid formula and the Megatron-11b preset.
(tests/distributed/test_fairseq.py checks all of it against fairseq itself.)"""
import argparse
import math
import sys

import pytest
import torch

from megatron.model.positions import sinusoidal_table
from megatron.tokenizer.fairseq_dict import DictionaryError, gpt2_ids, read_dictionary
from tasks.fairseq_lm.stream import FairseqBlocks, encode_lines, fairseq_metrics
from tests.unit.test_examples import parsed_launch


def _dict(tmp_path, text):
    path = tmp_path / "dict.txt"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_dictionary_order_specials_and_gpt2_ids(tmp_path):
    path = _dict(tmp_path, "13 50\n262 40\n11 40 #fairseq:overwrite\n13 3 #fairseq:overwrite\n"
                           "madeupword0000 0\n")
    symbols = read_dictionary(path)
    assert symbols == ["<s>", "<pad>", "</s>", "<unk>", "13", "262", "11", "13", "madeupword0000"]
    assert gpt2_ids(symbols) == [None] * 4 + [13, 262, 11, 13, None]


@pytest.mark.parametrize("text, message", [
    ("13 50\nnot-a-count\n", "line 2"), ("13 50\n13 4\n", "duplicate symbol '13'"),
    ("", "is empty"), ("13 x\n", "line 1")])
def test_malformed_dictionaries_are_refused(tmp_path, text, message):
    with pytest.raises(DictionaryError, match=message):
        read_dictionary(_dict(tmp_path, text))


def test_non_gpt2_symbols_are_refused(tmp_path):
    with pytest.raises(DictionaryError, match="not a GPT-2 BPE id"):
        gpt2_ids(read_dictionary(_dict(tmp_path, "the 10\n")))


class _Chars:
    """A tokenizer with one id per character (id = code point), </s> = 2."""
    eod = 2

    def tokenize(self, text):
        return [ord(c) for c in text]


def test_stream_appends_eos_per_line_and_keeps_empty_lines():
    assert encode_lines(" ab \n\nc\n", _Chars()) == [97, 98, 2, 2, 99, 2]


@pytest.mark.parametrize("n, tokens_per_sample, context", [(1, 8, 0), (37, 8, 5), (40, 8, 4),
                                                           (9, 16, 15)])
def test_blocks_score_every_token_once_with_bounded_context(n, tokens_per_sample, context):
    stream = list(range(10, 10 + n))
    blocks = FairseqBlocks(stream, tokens_per_sample, context, eos=2, num_original_tokens=1)
    scored = []
    for i in range(len(blocks)):
        tokens, mask = blocks[i]
        inputs, labels = tokens[:-1], tokens[1:]
        positions = [j for j in range(tokens_per_sample) if mask[j]]
        first = positions[0]
        assert first == min(context, i * blocks.block)  # up to C tokens of context
        assert positions == list(range(first, first + len(positions)))
        scored += labels[positions].tolist()
        previous = [2] + stream  # input j is the token before target j, </s> first
        start = i * blocks.block - first
        assert inputs[:first + len(positions)].tolist() == previous[start:start + first + len(positions)]
    assert scored == stream


def test_metrics_are_base_2_and_renormalised_by_words():
    m = fairseq_metrics(total_nats=1000.0, num_tokens=500, num_words=400)
    assert math.isclose(m["loss (base 2)"], 2.0 / math.log(2))
    assert math.isclose(m["ppl"], math.e ** 2)
    assert math.isclose(m["renormalized ppl"], 2 ** (math.log2(m["ppl"]) * 500 / 400))


def test_missing_sacremoses_is_one_line_exit_2(monkeypatch, capsys):
    from tasks import main as tasks_main
    monkeypatch.setitem(sys.modules, "sacremoses", None)
    ns = argparse.Namespace(task="WIKITEXT103", context_window=0, detokenizer="fairseq",
                            fairseq_eval_lm=False, valid_data=["x.tokens"], overlapping_eval=None)
    with pytest.raises(SystemExit) as exit_info:
        tasks_main.check_flags(ns, 16)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert "pip install sacremoses" in err


def test_sinusoids_are_fairseqs_formula():
    dim, offset = 10, 2
    table = sinusoidal_table(6, dim)
    half = dim // 2
    for p in range(6):
        for i in range(half):
            angle = (p + offset) * math.exp(-i * math.log(10000) / (half - 1))
            assert math.isclose(table[p, i].item(), math.sin(angle), abs_tol=1e-5)
            assert math.isclose(table[p, half + i].item(), math.cos(angle), abs_tol=1e-5)
    assert sinusoidal_table(3, 7)[:, -1].abs().sum() == 0  # odd width: a zero column
    assert table.dtype == torch.float32


def test_megatron_11b_preset_is_fairseqs(tmp_path):
    config, world = parsed_launch(tmp_path, "megatron_11b.sh")
    m, t, o = config.model, config.training, config.optimizer
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads) == (72, 3072, 18432, 32)
    assert (m.seq_length, m.max_position_embeddings) == (1024, 1024)
    assert m.position_embedding_type == "sinusoidal" and m.scale_embeddings
    assert m.activation == "exact_gelu" and not m.untie_embeddings_and_output_weights
    assert (m.hidden_dropout, m.attention_dropout) == (0.1, 0.1)
    assert o.clip_grad == 0.0 and o.lr == 1.5e-4 and o.lr_decay_style == "inverse-square-root"
    assert (o.adam_beta1, o.adam_beta2, o.adam_eps, o.weight_decay) == (0.9, 0.98, 1e-8, 0.01)
    assert t.fp16 and t.micro_batch_size == 2 and t.global_batch_size == 2 * world // 8
    assert config.parallel.tensor_model_parallel_size == 8
