"""Attention sinks (--softmax-type): every attention path against a plain reference (an
explicit softmax over [scores, sink]), outputs and the gradients of q, k, v and the sink
logits, with a sliding window and with the queries of a KV cache; gradcheck in float64;
off-by-one; which path auto takes; the KV cache in generation; refusals; TP sharding."""
import math

import pytest
import torch

from megatron.config import ConfigError, ModelConfig
from megatron.model.attention import CoreAttention
from megatron.mpu.sharding import merge_shards, parameter_meta, shard_tensor

HEADS, D, B = 4, 16, 2


def _cfg(**changes):
    fields = dict(num_layers=2, hidden_size=HEADS * D, num_attention_heads=HEADS,
                  seq_length=32, max_position_embeddings=64, attention_dropout=0.0,
                  hidden_dropout=0.0, softmax_type="learnable", padded_vocab_size=128)
    fields.update(changes)
    return ModelConfig(**fields)


def reference(q, k, v, sinks, window=None, scale=None):
    """q [sq, b, h, d], k / v [sk, b, h, d] (queries the last sq positions) -> [sq, b, h * d]:
    softmax over [scores, sink] by its definition, the sink column dropped; scores are
    q k^T times `scale` (None: 1 / sqrt(d))."""
    sq, sk = q.shape[0], k.shape[0]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    query = torch.arange(sk - sq, sk)[:, None]
    key = torch.arange(sk)[None, :]
    hidden = key > query
    if window is not None:
        hidden |= key <= query - window
    scores = scores.masked_fill(hidden, float("-inf"))
    column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhqk,kbhd->qbhd", probs, v).reshape(sq, q.shape[1], -1)


def _inputs(sq, sk, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, B, HEADS, D, generator=gen, dtype=dtype)
    k, v = torch.randn(2, sk, B, HEADS, D, generator=gen, dtype=dtype)
    sinks = torch.randn(HEADS, generator=gen, dtype=dtype) * 2
    dout = torch.randn(sq, B, HEADS * D, generator=gen, dtype=dtype)
    return q, k, v, sinks, dout


def _grads(fn, q, k, v, sinks, dout):
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = fn(*leaves)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def _core(impl, window=None, dtype=torch.float32, **changes):
    return CoreAttention(_cfg(attention_impl=impl, window_size=window, **changes), 1, HEADS,
                         None, dtype)


@pytest.mark.parametrize("impl", ["auto", "sdpa", "fused", "torch"])
@pytest.mark.parametrize("window,sq,sk,scale", [(None, 24, 24, None), (5, 24, 24, None),
                                                (None, 3, 20, None), (6, 1, 20, None),
                                                (None, 24, 24, 0.07), (6, 1, 20, 0.07)])
def test_every_path_equals_the_reference_with_gradients(impl, window, sq, sk, scale):
    core = _core(impl, window, softmax_scale=scale)
    q, k, v, sinks, dout = _inputs(sq, sk)

    def ours(q, k, v, s):
        return torch.func.functional_call(core, {"softmax_offset": s}, (q, k, v, None))
    got = _grads(ours, q, k, v, sinks, dout)
    want = _grads(lambda *t: reference(*t, window=window, scale=scale), q, k, v, sinks, dout)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"{impl} {name}")
    assert got[-1].abs().min() > 0  # every head's sink gets a gradient


@pytest.mark.parametrize("impl", ["sdpa", "torch"])
def test_gradcheck_in_float64(impl):
    core = _core(impl, window=4, dtype=torch.float64)
    q, k, v, sinks, _ = _inputs(6, 6, torch.float64, seed=1)

    def ours(q, k, v, s):
        return torch.func.functional_call(core, {"softmax_offset": s}, (q, k, v, None))
    inputs = [t[:, :1, :, :4].clone().requires_grad_() for t in (q, k, v)]
    inputs.append(sinks.clone().requires_grad_())
    assert torch.autograd.gradcheck(ours, inputs, eps=1e-6, atol=1e-6, fast_mode=True)


def test_off_by_one_is_a_fixed_zero_logit_not_saved():
    core = _core("torch", softmax_type="off-by-one")
    assert list(core.named_parameters()) == [] and "softmax_offset" not in core.state_dict()
    q, k, v, _, _ = _inputs(10, 10)
    torch.testing.assert_close(core(q, k, v, None), reference(q, k, v, torch.zeros(HEADS)),
                               rtol=1e-5, atol=1e-6)
    vanilla = CoreAttention(_cfg(softmax_type="vanilla", attention_impl="torch"), 1, HEADS)
    assert vanilla.softmax_offset is None
    assert not torch.allclose(core(q, k, v, None), vanilla(q, k, v, None))


@pytest.mark.parametrize("scale", [None, 0.07])
def test_auto_takes_our_cpu_kernel_with_sinks(monkeypatch, capsys, scale):
    """Where `auto` prefers our kernel, it serves the sinks (its `sinks=` input), equal to
    the reference with gradients."""
    from megatron import fused
    from megatron.fused import paths
    monkeypatch.setattr(paths, "_ANNOUNCED", set())
    monkeypatch.setattr(fused, "causal_attention_preferred", lambda *a, **k: True)
    core = _core("auto", softmax_scale=scale)
    q, k, v, sinks, dout = _inputs(16, 16)

    def ours(q, k, v, s):
        return torch.func.functional_call(core, {"softmax_offset": s}, (q, k, v, None))
    got = _grads(ours, q, k, v, sinks, dout)
    assert "attention: our CPU kernel (auto" in capsys.readouterr().out
    want = _grads(lambda *t: reference(*t, scale=scale), q, k, v, sinks, dout)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)


def test_learnable_sinks_are_split_over_tp_with_their_heads():
    core = _core("torch")
    meta = parameter_meta(core.softmax_offset)
    assert meta == {"dim": 0, "groups": 1}
    full = torch.arange(8.0)
    shards = [shard_tensor(full, meta, r, 2) for r in range(2)]
    assert shards[1].tolist() == [4.0, 5.0, 6.0, 7.0]
    assert torch.equal(merge_shards(shards, meta), full)


def test_kv_cache_generation_equals_recomputation_with_sinks():
    from megatron.model import GPTModel
    from megatron.mpu import model_parallel_seed
    from megatron.text_generation import generate
    from megatron.tokenizer import ByteLevelTokenizer
    model_parallel_seed(1234, 0)
    model = GPTModel(_cfg(padded_vocab_size=384, position_embedding_type="rope",
                          window_size=6))
    model.init_weights(3)
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("softmax_offset"):
                p.normal_(0, 2)
    tok = ByteLevelTokenizer()
    prompts = ["Hello", "a longer prompt here"]
    cached = generate(model, tok, prompts, 24, greedy=True, eod_stop=False)
    full = generate(model, tok, prompts, 24, greedy=True, eod_stop=False, use_cache=False)
    assert cached == full and [len(t) for t in cached] == [24, 24]


@pytest.mark.parametrize("changes,message", [
    (dict(softmax_type="learnable", position_embedding_type="alibi"),
     "--softmax-type learnable does not combine with ALiBi"),
    (dict(softmax_type="sink"), "--softmax-type 'sink' is not one of"),
])
def test_bad_settings_are_one_line(changes, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(**changes)


def test_the_flag_reaches_the_config():
    from megatron.arguments import parse_args
    from tests.gpt_setup import tiny_gpt_argv
    cfg = parse_args(tiny_gpt_argv("data", "cache", "--softmax-type", "off-by-one"),
                     world_size=1)[0]
    assert cfg.model.softmax_type == "off-by-one"


@pytest.mark.parametrize("extra,words", [
    (["--softmax-type", "learnable", "--position-embedding-type", "alibi"],
     ["--softmax-type learnable does not combine with ALiBi"]),
    (["--quick-geglu", "--activation-func-clamp-value", "-7"],
     ["--activation-func-clamp-value must be positive, got -7.0"]),
    (["--glu-linear-offset", "1"], ["--glu-linear-offset 1.0 needs a gated activation"]),
])
def test_bad_flags_exit_2_with_one_line(capsys, extra, words):
    from megatron.arguments import parse_args
    from tests.gpt_setup import assert_exits_2_with_one_line, tiny_gpt_argv
    assert_exits_2_with_one_line(
        capsys, lambda: parse_args(tiny_gpt_argv("data", "cache", *extra), world_size=1), words)
