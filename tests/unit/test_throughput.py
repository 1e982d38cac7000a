"""--log-throughput: FLOPs of an iteration counted by hand, and the log line's TFLOP/s and MFU."""
import re
import time

import pytest
import torch

import pretrain_gpt
from megatron.config import ModelConfig
from megatron.training import flops
from megatron.training.logging import TensorBoard
from tests.gpt_setup import preprocess_wiki, tiny_gpt_argv


def _gqa_swiglu(**extra):
    return ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                       max_position_embeddings=32, ffn_hidden_size=96, padded_vocab_size=256,
                       group_query_attention=True, num_query_groups=2, kv_channels=24,
                       activation="swiglu", **extra)


def test_flops_counted_by_hand():
    cfg = _gqa_swiglu()
    b, s, h, L, V = 3, 32, 64, 2, 256
    T = b * s                          # tokens in the batch
    q, kv = 4 * 24, 2 * 24             # query width (heads x kv_channels), key/value width (groups x kv)
    qkv = 2 * T * h * (q + kv + kv)    # [T, h] x [h, q + 2 kv]
    scores = 2 * T * s * q             # per head: [s, d] x [d, s], for each of the b sequences
    context = 2 * T * s * q            # per head: [s, s] x [s, d]
    dense = 2 * T * q * h              # [T, q] x [q, h]
    mlp = 2 * T * h * 96 * 2 + 2 * T * 96 * h   # gate and up [h, ffn] each, down [ffn, h]
    logits = 2 * T * h * V
    forward = L * (qkv + scores + context + dense + mlp) + logits
    assert flops.model_flops(cfg, b) == 3 * forward
    assert flops.hardware_flops(cfg, b) == 3 * forward
    full = _gqa_swiglu(recompute_granularity="full")
    assert flops.hardware_flops(full, b) == 3 * forward + L * (qkv + scores + context + dense + mlp)
    assert flops.model_flops(full, b) == 3 * forward  # MFU does not count recomputation
    selective = _gqa_swiglu(recompute_granularity="selective")
    assert flops.hardware_flops(selective, b) == 3 * forward + L * (scores + context)


def test_plain_gpt_matches_megatron_lm_closed_form():
    """With multi-head attention and a GeLU MLP the count is Megatron-LM's
    72 B s L h^2 (1 + s / 6h + V / 12 L h)."""
    cfg = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256,
                      max_position_embeddings=256, padded_vocab_size=8064)
    b, s, L, h, V = 8, 256, 4, 256, 8064
    closed = 72 * b * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert flops.model_flops(cfg, b) == pytest.approx(closed, rel=1e-12)


def test_matmul_probe_is_short_and_positive():
    start = time.perf_counter()
    rate = flops.matmul_rate(torch.device("cpu"), torch.float32)
    assert time.perf_counter() - start < 1.0
    assert rate > 1e8


def test_log_line_shows_tflops_and_mfu_that_agree_with_the_flop_count(tmp_path, capsys, monkeypatch):
    prefix = preprocess_wiki(tmp_path, docs=200)
    logged = []
    monkeypatch.setattr(TensorBoard, "scalars", lambda self, values, step: logged.append(values))
    pretrain_gpt.main(tiny_gpt_argv(prefix, tmp_path / "cache", "--log-throughput",
                                    "--peak-flops", "0.05", layers=2, iters=3))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(" iteration ")]
    assert len(lines) == 3
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                      max_position_embeddings=32, padded_vocab_size=8000)
    for line in lines:
        ms = float(re.search(r"elapsed time per iteration \(ms\): ([\d.]+)", line).group(1))
        tflops = float(re.search(r"throughput per CPU process \(TFLOP/s/CPU\): ([\d.e+-]+) \|",
                                 line).group(1))
        mfu = float(re.search(r"MFU: ([\d.]+)%", line).group(1))
        tokens = float(re.search(r"tokens per second: ([\d.]+)", line).group(1))
        expected = flops.model_flops(cfg, 8) / (ms / 1000) / 1e12
        assert tflops == pytest.approx(expected, rel=0.06 / ms + 1e-3)  # ms is rounded to 0.1
        assert mfu == pytest.approx(100 * tflops / 0.05, rel=2e-3, abs=0.006)  # printed to 0.01%
        assert tokens == pytest.approx(8 * 32 / (ms / 1000), rel=0.06 / ms + 1e-3)
    assert {"throughput", "tokens-per-second", "mfu"} <= set(logged[0])
