"""Gemma 3's layer features: the (1 + w) RMSNorm against transformers' Gemma3RMSNorm, the
sandwich norms against the layer's formula, --softmax-scale on every single-process
attention path (explicit, our softmax, SDPA, our CPU kernel, windowed masks; the KV cache
in test_model_spec.py) against a direct softmax(s q k^T) v, and --no-rope-scaling-local.
The context-parallel paths are checked in tests/distributed/test_context_parallel.py, the
whole model against transformers in the conversion tests."""
import pytest
import torch

from megatron import fused
from megatron.model.spec import RMSNorm1P, make_post_norm
from megatron.model.attention import CoreAttention
from megatron.training.memory import layer_params
from tests import oracles
from megatron.arguments import parse_args
from tests.unit.test_model_spec import BASE, LLAMA, config, model_of, tokens_of

GEMMA3 = dict(LLAMA, apply_layernorm_1p=True, qk_layernorm=True, sandwich_norm=True,
              softmax_scale=0.1, kv_channels=16, activation="geglu_tanh")


@oracles.needs("transformers")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fusion", [True, False])
def test_rms_norm_1p_is_gemma3s(dtype, fusion):
    """Normalised and multiplied by 1 + w in float32, then cast (not cast, then multiplied)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 3, 48, generator=gen) * 3).to(dtype)
    weight = (torch.randn(48, generator=gen) * 0.5).to(dtype)
    theirs, ours = Gemma3RMSNorm(48, eps=1e-6).to(dtype), RMSNorm1P(48, eps=1e-6, fusion=fusion)
    with torch.no_grad():
        theirs.weight.copy_(weight)
        ours = ours.to(dtype)
        ours.weight.copy_(weight)
        want, got = theirs(x), ours(x)
    assert got.dtype == dtype
    if dtype == torch.bfloat16 and not fusion:
        assert torch.equal(got, want)
    else:  # the fused kernel reduces in another order; bf16: one rounding step at most
        tol = 1e-6 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_sandwich_norms_normalise_each_branch_output():
    """layer(x) = h + N4(MLP(N3(h))), h = x + N2(Attn(N1(x))), N2 / N4 the sandwich norms."""
    cfg = config(**GEMMA3)
    layer = model_of(cfg).language_model.encoder.layers[0]
    x = torch.randn(12, 2, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, _ = layer.self_attention(layer.input_layernorm(x), None)
        h = x + layer.post_self_attention_layernorm(out)
        out, _ = layer.mlp(layer.post_attention_layernorm(h))
        want = h + layer.post_mlp_layernorm(out)
        torch.testing.assert_close(layer(x), want, rtol=0, atol=0)
    assert make_post_norm(config(**LLAMA), None, torch.float32) is None
    per_layer = sum(p.numel() for p in layer.parameters())
    assert layer_params(cfg, 1) == per_layer  # the memory estimate counts the two norms


def _reference(q, k, v, scale, window=None):
    """softmax(scale q k^T) v, causal (and within `window`), [s, b, h, d] -> [s, b, h * d]."""
    s = q.shape[0]
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    pos = torch.arange(s)
    hidden = pos[None, :] > pos[:, None]
    if window is not None:
        hidden |= pos[None, :] <= pos[:, None] - window
    probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,kbhd->qbhd", probs, v).reshape(s, q.shape[1], -1)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("impl", ["torch", "fused", "sdpa", "auto"])
def test_softmax_scale_on_every_attention_path(impl, window, monkeypatch):
    calls = []
    kernel = fused.causal_attention
    monkeypatch.setattr(fused, "causal_attention", lambda *a: calls.append(a[3]) or kernel(*a))
    cfg = config(**GEMMA3, attention_impl=impl, window_size=window)
    core = CoreAttention(cfg, 1).eval()
    gen = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(3, 16, 2, 4, 16, generator=gen)
    got = core(q, k, v, None)
    torch.testing.assert_close(got, _reference(q, k, v, 0.1, window), rtol=1e-5, atol=1e-6)
    assert all(scale == 0.1 for scale in calls)  # our CPU kernel (auto, where it wins)
    default = CoreAttention(config(**dict(GEMMA3, softmax_scale=None), attention_impl=impl,
                                   window_size=window), 1).eval()
    torch.testing.assert_close(default(q, k, v, None), _reference(q, k, v, 0.25, window),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("extra, words", [
    (["--softmax-scale", "0"], "--softmax-scale must be positive, got 0.0"),
    (["--softmax-scale", "-0.5"], "--softmax-scale must be positive, got -0.5"),
    (["--position-embedding-type", "rope", "--rope-scaling-type", "llama3",
      "--no-rope-scaling-local"], "it does not apply to --rope-scaling-type llama3")])
def test_bad_settings_are_one_line(extra, words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(BASE + extra, world_size=1)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and words in err, err


def test_no_rope_scaling_local_scales_the_full_layers_only():
    cfg = config(**GEMMA3, num_layers=4, window_size=4, window_attn_skip_freq=2,
                 rotary_seq_len_interpolation_factor=8.0, rope_scaling_local=False)
    model = model_of(cfg)
    found = [layer.self_attention.rotary.interpolation
             for layer in model.language_model.encoder.layers]
    assert found == [None, 8.0, None, 8.0]
    assert [cfg.rope_scaled_for_layer(n) for n in range(1, 5)] == [False, True, False, True]
