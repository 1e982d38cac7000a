"""Sliding-window attention in every attention path, the RoPE scalings' flags, and the
one-line refusals of bad long-context settings."""
import math

import pytest
import torch

from megatron.config import ModelConfig
from megatron.model.attention import CoreAttention, windowed_mask


def _reference(q, k, v, window):
    """Plain softmax attention of the last sq of sk positions over a sliding window."""
    sq, sk = q.shape[0], k.shape[0]
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    query = torch.arange(sk - sq, sk)[:, None]
    key = torch.arange(sk)[None, :]
    allowed = (key <= query) & (key > query - window)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,kbhd->qbhd", probs, v)
    return out.reshape(sq, q.shape[1], -1)


@pytest.mark.parametrize("impl", ["auto", "sdpa", "fused", "torch"])
@pytest.mark.parametrize("sq", [12, 1, 4])  # training, and KV-cache steps of 1 and 4 tokens
def test_window_is_honoured_by_every_attention_path(impl, sq):
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=12,
                      max_position_embeddings=12, attention_dropout=0.0, window_size=5,
                      attention_impl=impl)
    attention = CoreAttention(cfg, 1).eval()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sq, 2, 4, 8, generator=gen)
    k, v = torch.randn(2, 12, 2, 4, 8, generator=gen)
    got = attention(q, k, v, None)
    torch.testing.assert_close(got, _reference(q, k, v, 5), rtol=1e-5, atol=1e-6)
    wide = CoreAttention(ModelConfig(**{**cfg.__dict__, "window_size": None}), 1).eval()
    assert (wide(q, k, v, None) - got).abs().max() > 1e-3  # the window changed something


def test_window_mask_joins_a_given_mask_and_is_skipped_when_inert():
    assert windowed_mask(None, 8, 8, 8, "cpu") is None
    given = torch.zeros(1, 1, 8, 8, dtype=torch.bool)
    given[..., 0] = True
    mask = windowed_mask(given, 8, 8, 3, "cpu")
    assert mask[0, 0, 7].tolist() == [True] * 5 + [False] * 3
    assert mask[0, 0, 2].tolist() == [True] + [False] * 2 + [True] * 5


def _parse(argv):
    from megatron.arguments import parse_args
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64", "--train-iters", "1",
            "--lr", "1e-3", "--position-embedding-type", "rope"]
    return parse_args(base + argv, world_size=1)[0]


def test_rope_scaling_flags():
    cfg = _parse(["--use-rope-scaling", "--rotary-scaling-factor", "32"]).model
    assert (cfg.rope_scaling_type, cfg.rope_scaling_factor) == ("llama3", 32.0)
    cfg = _parse(["--rope-scaling-type", "yarn", "--rope-scaling-factor", "4",
                  "--rope-scaling-original-max-position-embeddings", "16",
                  "--yarn-attention-factor", "1.2", "--window-size", "8"]).model
    assert (cfg.rope_scaling_type, cfg.rope_scaling_original_max_position_embeddings,
            cfg.yarn_attention_factor, cfg.window_size) == ("yarn", 16, 1.2, 8)


@pytest.mark.parametrize("argv, message", [
    (["--window-size", "0"], "--window-size must be a positive number of positions, got 0"),
    (["--window-size", "-3"], "--window-size must be a positive number of positions, got -3"),
    (["--rope-scaling-type", "dynamic"], "--rope-scaling-type: invalid choice: 'dynamic'"),
    (["--use-rope-scaling", "--rope-scaling-factor", "0.5"], "--rope-scaling-factor must be >= 1"),
    (["--use-rope-scaling", "--position-embedding-type", "alibi"],
     "--rope-scaling-type llama3 needs --position-embedding-type rope"),
])
def test_bad_long_context_settings_are_one_line_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        _parse(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and err.count("\n") == 1, err


def _parse_world(argv, world):
    from megatron.arguments import parse_args
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64", "--train-iters", "1",
            "--lr", "1e-3", "--position-embedding-type", "rope", "--attention-dropout", "0"]
    return parse_args(base + argv, world_size=world)[0]


@pytest.mark.parametrize("argv, world, message", [
    (["--context-parallel-size", "2", "--seq-length", "30", "--max-position-embeddings", "64"],
     2, "--seq-length (30) must be divisible by 2 x --context-parallel-size (4)"),
    (["--context-parallel-size", "4", "--tensor-model-parallel-size", "2"], 4,
     "--context-parallel-size (4) x --pipeline-model-parallel-size (1) must divide the world size (4)"),
    (["--context-parallel-size", "8", "--cp-comm-type", "a2a", "--seq-length", "64"], 8,
     "--cp-comm-type a2a needs the heads per TP rank (4) divisible by --context-parallel-size (8)"),
    (["--context-parallel-size", "2", "--reset-attention-mask"], 2,
     "--reset-attention-mask is not supported with --context-parallel-size 2"),
    (["--context-parallel-size", "2", "--position-embedding-type", "alibi"], 2,
     "ALiBi (--position-embedding-type alibi) is not supported with --context-parallel-size 2"),
    (["--context-parallel-size", "2", "--window-size", "8"], 2,
     "--window-size with --cp-comm-type p2p is not supported"),
    (["--context-parallel-size", "0"], 1, "--context-parallel-size must be >= 1, got 0"),
    (["--cp-comm-type", "ring"], 1, "--cp-comm-type: invalid choice: 'ring'"),
])
def test_bad_context_parallel_settings_are_one_line_exit_2(capsys, argv, world, message):
    with pytest.raises(SystemExit) as exit_info:
        _parse_world(argv, world)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and err.count("\n") == 1, err


def test_cp_settings_that_are_fine():
    config = _parse_world(["--context-parallel-size", "2", "--cp-comm-type", "a2a",
                           "--window-size", "8", "--tensor-model-parallel-size", "2"], 8)
    assert (config.parallel.context_parallel_size, config.parallel.cp_comm_type) == (2, "a2a")
    assert config.training.global_batch_size == 2  # DP = 8 / (TP 2 x CP 2)
