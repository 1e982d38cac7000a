"""The declarative model spec: each feature against an independent plain computation.

RoPE against a complex-number rotation, ALiBi slopes against their closed form,
RMSNorm and the gated MLP against direct formulas, grouped-query attention against
multi-head attention with repeated K/V weights, KV-cache decoding against the full
forward (LLaMA- and BLOOM-style), the sharding metadata's shard/merge round trip,
and one-line errors for bad combinations.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron.arguments import parse_args
from megatron.config import ModelConfig
from megatron import fused
from megatron.model import GPTModel
from megatron.model.positions import AlibiBias, RotaryEmbedding, alibi_slopes, apply_rotary
from megatron.mpu.sharding import merge_shards, qkv_meta, shard_tensor
from megatron.mpu import model_parallel_seed
from megatron.text_generation import KVCache, forward_full, forward_with_cache

LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
             group_query_attention=True, num_query_groups=2,
             untie_embeddings_and_output_weights=True, add_bias_linear=False)
BLOOM = dict(position_embedding_type="alibi", embed_layernorm=True)


def config(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16,
                max_position_embeddings=16, padded_vocab_size=96, hidden_dropout=0.0,
                attention_dropout=0.0)
    base.update(kw)
    return ModelConfig(**base)


def model_of(cfg, seed=5) -> GPTModel:
    model_parallel_seed(1234, 0)
    model = GPTModel(cfg)
    model.init_weights(seed)
    with torch.no_grad():  # non-trivial norms and biases
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def tokens_of(b=2, s=12, vocab=96, seed=0):
    ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))
    return ids, torch.arange(s).unsqueeze(0).expand(b, s)


# -- positions ----------------------------------------------------------------------------
@pytest.mark.parametrize("percent, interpolation", [(1.0, None), (0.5, None), (1.0, 4.0)])
def test_rope_is_a_complex_rotation(percent, interpolation):
    cfg = config(position_embedding_type="rope", rotary_percent=percent, rotary_base=500,
                 rotary_seq_len_interpolation_factor=interpolation)
    s, d, rd = 7, cfg.kv_channels, cfg.rotary_dim
    x = torch.randn(s, 2, 3, d, dtype=torch.float64)
    cos, sin = RotaryEmbedding(cfg)(s, 3, x.device)
    got = apply_rotary(x, cos.double(), sin.double())
    pos = (torch.arange(3, 3 + s, dtype=torch.float64) / (interpolation or 1.0))[:, None]
    theta = pos * 500.0 ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)  # [s, rd/2]
    z = torch.complex(x[..., :rd // 2], x[..., rd // 2:rd]) * torch.polar(
        torch.ones_like(theta), theta)[:, None, None, :]
    want = torch.cat((z.real, z.imag, x[..., rd:]), dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_alibi_slopes_closed_form():
    eight = [2.0 ** -(i + 1) for i in range(8)]
    assert alibi_slopes(8).tolist() == pytest.approx(eight)
    assert alibi_slopes(12).tolist() == pytest.approx(eight + [2.0 ** -(k / 2) for k in (1, 3, 5, 7)])
    assert alibi_slopes(4).tolist() == pytest.approx([2.0 ** (-2 * (i + 1)) for i in range(4)])
    cfg = config(position_embedding_type="alibi", num_attention_heads=12, hidden_size=48)
    bias = AlibiBias(cfg, tp_rank=1, tp_size=2)(5, torch.float32, "cpu")  # heads 6..11
    assert bias.shape == (6, 1, 5)
    torch.testing.assert_close(bias[:, 0, :], alibi_slopes(12)[6:, None] * torch.arange(5.0))


# -- norms and MLP ------------------------------------------------------------------------
@pytest.mark.parametrize("one_p", [False, True])
def test_rms_norm_and_layernorm_1p(one_p):
    x = torch.randn(5, 3, 64)
    w = torch.randn(64)
    rms = model_of(config(normalization="RMSNorm", apply_layernorm_1p=one_p))
    norm = rms.language_model.encoder.final_layernorm
    assert not hasattr(norm, "bias")
    if one_p:
        assert torch.equal(GPTModel(config(normalization="RMSNorm", apply_layernorm_1p=True))
                           .language_model.encoder.final_layernorm.weight, torch.zeros(64))
    with torch.no_grad():
        norm.weight.copy_(w)
    scale = (1 + w) if one_p else w
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * scale
    torch.testing.assert_close(norm(x), want, rtol=1e-5, atol=1e-5)
    ln = model_of(config(apply_layernorm_1p=one_p)).language_model.encoder.final_layernorm
    with torch.no_grad():
        ln.weight.copy_(w)
    torch.testing.assert_close(ln(x), F.layer_norm(x, (64,), scale, ln.bias, 1e-5))


@pytest.mark.parametrize("activation, gate", [
    ("swiglu", F.silu), ("geglu", F.gelu), ("reglu", F.relu), ("liglu", lambda t: t)])
def test_gated_mlp(activation, gate):
    cfg = config(activation=activation)
    assert cfg.ffn_hidden_size == int(4 * 64 * 2 / 3 / 64) * 64 == 128
    mlp = model_of(cfg).language_model.encoder.layers[0].mlp
    w1, b1 = mlp.dense_h_to_4h.weight, mlp.dense_h_to_4h.bias
    w2, b2 = mlp.dense_4h_to_h.weight, mlp.dense_4h_to_h.bias
    assert w1.shape == (256, 64)
    x = torch.randn(3, 2, 64)
    h = x @ w1.T + b1
    want = (gate(h[..., :128]) * h[..., 128:]) @ w2.T
    out, bias = mlp(x)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(bias, b2)


@pytest.mark.parametrize("activation, fn", [
    ("openai_gelu",
     lambda t: 0.5 * t * (1 + torch.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t ** 3)))),
    ("squared_relu", lambda t: torch.relu(t) ** 2)])
def test_plain_activations(activation, fn):
    mlp = model_of(config(activation=activation)).language_model.encoder.layers[0].mlp
    x = torch.randn(3, 2, 64)
    h = x @ mlp.dense_h_to_4h.weight.T + mlp.dense_h_to_4h.bias
    torch.testing.assert_close(mlp(x)[0], fn(h) @ mlp.dense_4h_to_h.weight.T, rtol=1e-5, atol=1e-5)


# -- attention ----------------------------------------------------------------------------
def _expand_qkv(t, heads, groups, d):
    """GQA rows [group: q heads, k, v] -> MHA rows [head: q, k, v] with repeated k / v."""
    view = t.reshape(groups, heads // groups + 2, d, *t.shape[1:])
    rows = []
    for g in range(groups):
        for q in range(heads // groups):
            rows += [view[g, q], view[g, -2], view[g, -1]]
    return torch.cat(rows)


@pytest.mark.parametrize("groups", [1, 2])
def test_grouped_query_attention_is_mha_with_repeated_kv(groups):
    gqa = model_of(config(group_query_attention=True, num_query_groups=groups, add_qkv_bias=True,
                          kv_channels=8))
    mha = model_of(config(add_qkv_bias=True, kv_channels=8))
    state = gqa.state_dict()
    for name in list(state):
        if "query_key_value" in name:
            state[name] = _expand_qkv(state[name], 4, groups, 8)
    mha.load_state_dict(state)
    ids, pos = tokens_of()
    torch.testing.assert_close(gqa(ids, pos), mha(ids, pos), rtol=1e-5, atol=1e-5)


def test_sdpa_with_alibi_matches_the_explicit_path():
    ids, pos = tokens_of()
    explicit = model_of(config(attention_impl="torch", **BLOOM))
    sdpa = model_of(config(attention_impl="sdpa", **BLOOM))
    torch.testing.assert_close(sdpa(ids, pos), explicit(ids, pos), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", [{}, LLAMA], ids=["gpt", "llama"])
def test_cpu_attention_kernel_is_the_auto_choice_and_matches_sdpa(arch, monkeypatch):
    """auto on a CPU in float32: our causal-attention kernel (losses and gradients as SDPA's)."""
    from megatron import fused
    from megatron.fused import kernels as fused_kernels
    if not fused_kernels.load_fused_kernels():
        pytest.skip("fused kernels unavailable")
    calls = []
    kernel = fused.causal_attention
    monkeypatch.setattr(fused, "causal_attention", lambda *a: calls.append(1) or kernel(*a))
    ids, pos = tokens_of()
    labels = torch.roll(ids, -1, dims=1)
    results = []
    for impl in ("auto", "sdpa"):
        model = model_of(config(attention_impl=impl, kv_channels=16, **arch)).train()
        loss = model(ids, pos, labels=labels).mean()
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    assert len(calls) == 2  # both layers of the auto model, none of the sdpa one
    (auto_loss, auto_grads), (sdpa_loss, sdpa_grads) = results
    torch.testing.assert_close(auto_loss, sdpa_loss, rtol=1e-6, atol=1e-6)
    for a, b in zip(auto_grads, sdpa_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("arch", [LLAMA, BLOOM, dict(qk_layernorm=True, apply_layernorm_1p=True),
                                  dict(LLAMA, qk_layernorm=True, apply_layernorm_1p=True,
                                       sandwich_norm=True, softmax_scale=0.1, window_size=4),
                                  dict(LLAMA, rotary_interleaved=True, qk_l2_norm=True,
                                       attention_chunk_size=4, no_rope_freq=2,
                                       attn_temperature_tuning=True,
                                       attn_temperature_floor_scale=3)],
                         ids=["llama", "bloom", "qk-layernorm", "gemma3-layer", "llama4-layers"])
def test_kv_cache_decoding_equals_the_full_forward(arch):
    model = model_of(config(**arch))
    ids, _ = tokens_of(s=12)
    full = forward_full(model, ids)
    cache = KVCache.for_model(model, 2, 12)
    parts = [forward_with_cache(model, ids[:, a:b], cache, last_only=False)
             for a, b in ((0, 5), (5, 6), (6, 9), (9, 12))]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


def test_untied_model_has_an_output_layer_and_no_head_copy():
    names = set(GPTModel(config(**LLAMA)).state_dict())
    assert "language_model.output_layer.weight" in names
    assert "language_model.embedding.position_embeddings.weight" not in names
    assert not [n for n in names if n.endswith("bias")]
    last = GPTModel(config(**LLAMA), pre_process=False)
    assert last.word_embeddings_for_head is None
    assert last.head_weight() is last.language_model.output_layer.weight
    bloom = set(GPTModel(config(**BLOOM)).state_dict())
    assert {"language_model.embedding.word_embeddings.norm.weight",
            "language_model.embedding.word_embeddings.norm.bias"} <= bloom


# -- sharding metadata --------------------------------------------------------------------
@pytest.mark.parametrize("meta, rows, tp", [
    (qkv_meta(2, 4, 3), (4 + 4) * 3, 2), (qkv_meta(2, 4, 3), 24, 4), (qkv_meta(1, 4, 3), 18, 4),
    ({"dim": 0, "groups": 2}, 16, 4), ({"dim": 1, "groups": 1}, 8, 2)])
def test_shard_and_merge_are_inverse(meta, rows, tp):
    full = torch.randn(rows, 8) if meta["dim"] == 0 else torch.randn(5, rows)
    shards = [shard_tensor(full, meta, r, tp) for r in range(tp)]
    assert torch.equal(merge_shards(shards, meta), full)


def test_shards_follow_the_row_layouts():
    gated = torch.arange(8.0)[:, None]  # [gate 0..3; up 4..7]
    assert shard_tensor(gated, {"dim": 0, "groups": 2}, 1, 2).flatten().tolist() == [2, 3, 6, 7]
    # 4 heads, 1 group, head_dim 1: rows [q0 q1 q2 q3 k v]; TP 2 -> [q0 q1 k v], [q2 q3 k v]
    qkv = torch.arange(6.0)[:, None]
    meta = qkv_meta(1, 4, 1)
    assert shard_tensor(qkv, meta, 1, 2).flatten().tolist() == [2, 3, 4, 5]


def test_sharding_metadata_of_the_model():
    meta = GPTModel(config(**LLAMA)).sharding_metadata()
    assert meta["language_model.encoder.layers.0.mlp.dense_h_to_4h.weight"] == {"dim": 0, "groups": 2}
    assert meta["language_model.encoder.layers.0.self_attention.query_key_value.weight"] == \
        qkv_meta(2, 4, 16)
    assert meta["language_model.encoder.layers.0.self_attention.dense.weight"]["dim"] == 1
    assert meta["language_model.output_layer.weight"] == {"dim": 0, "groups": 1}
    assert meta["language_model.encoder.final_layernorm.weight"]["dim"] is None


# -- errors -------------------------------------------------------------------------------
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--train-iters", "1", "--lr", "1e-3"]


@pytest.mark.parametrize("extra, world, words", [
    (["--group-query-attention", "--num-query-groups", "3"], 1, "--num-query-groups (3)"),
    (["--group-query-attention", "--num-query-groups", "6", "--tensor-model-parallel-size", "4",
      "--num-attention-heads", "12", "--hidden-size", "48"], 4, "--num-query-groups (6)"),
    (["--use-rotary-position-embeddings", "--rotary-percent", "1.5"], 1, "--rotary-percent"),
    (["--use-rotary-position-embeddings", "--rotary-percent", "0.01"], 1, "rotates no channel"),
    (["--pad-vocab-size-to", "0"], 1, "--pad-vocab-size-to"),
])
def test_bad_combinations_are_one_line_errors(extra, world, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(BASE + extra, world_size=world)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and words in err and len(err.splitlines()) == 1, err


def test_pad_vocab_size_to():
    from megatron.tokenizer import padded_vocab_size
    assert padded_vocab_size(1000, 128, 2, pad_to=1002) == 1002
    with pytest.raises(ValueError, match="must be >= the tokenizer's 1000 ids"):
        padded_vocab_size(1000, 128, 2, pad_to=998)
    with pytest.raises(ValueError, match="divisible by --tensor-model-parallel-size 4"):
        padded_vocab_size(1000, 128, 4, pad_to=1002)


def test_llama_and_bloom_flags_fill_the_spec():
    cfg = parse_args(BASE + ["--use-rotary-position-embeddings", "--normalization", "RMSNorm",
                             "--swiglu", "--group-query-attention", "--num-query-groups", "2",
                             "--untie-embeddings-and-output-weights", "--disable-bias-linear"],
                     world_size=1)[0].model
    assert (cfg.position_embedding_type, cfg.normalization, cfg.activation) == \
        ("rope", "RMSNorm", "swiglu")
    assert cfg.num_query_groups == 2 and not cfg.add_bias_linear and cfg.ffn_hidden_size == 128
    bloom = parse_args(BASE + ["--position-embedding-type", "alibi", "--embed-layernorm"],
                       world_size=1)[0].model
    assert bloom.position_embedding_type == "alibi" and bloom.embed_layernorm
    assert fused.RMSNorm  # the norm class the spec builds


def test_lambada_never_predicts_a_padding_id():
    from tasks.zeroshot_gpt.evaluate import score
    output = torch.zeros(1, 2, 8)
    output[0, :, 3] = 1.0
    output[0, :, 6] = 5.0  # a padding row (tokenizer vocabulary: 5 ids) scores highest
    batch = {"labels": torch.tensor([[3, 3]]), "loss_mask": torch.ones(1, 2),
             "valid": torch.ones(1)}
    assert score("LAMBADA", batch, output, vocab_size=5)[0].item() == 1.0
    assert score("LAMBADA", batch, output)[0].item() == 0.0
