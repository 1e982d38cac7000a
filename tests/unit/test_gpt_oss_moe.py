"""gpt-oss's MoE against transformers' GptOssMLP: the router with bias (softmax over the
top-k logits), per-expert biases on both linears and the clamped quick-GeGLU ((up + 1),
alpha 1.702, limit 7) over HF's interleaved gate / up columns, converted by
megatron/checkpointing/hf/gpt_oss.py; the flags; the dense MLP's activation; refusals."""
import pytest
import torch

from megatron.config import ConfigError, ModelConfig, MoEConfig
from megatron.model.moe.layer import MoELayer
from megatron.mpu.parallel_state import ExpertGroups
from tests import oracles

H, F, E, K = 32, 16, 4, 2


def _cfg(**changes):
    fields = dict(num_layers=2, hidden_size=H, num_attention_heads=4, seq_length=8,
                  max_position_embeddings=8, activation="quick_geglu", glu_linear_offset=1.0,
                  activation_func_clamp_value=7.0, padded_vocab_size=16, hidden_dropout=0.0,
                  attention_dropout=0.0, moe=MoEConfig(num_experts=E, moe_router_topk=K,
                                                       moe_ffn_hidden_size=F))
    fields.update(changes)
    return ModelConfig(**fields)


def _hf_mlp():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    config = GptOssConfig(hidden_size=H, intermediate_size=F, num_local_experts=E,
                          num_experts_per_tok=K, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8)
    mlp = GptOssMLP(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 1.5)  # large: the clamps bite
    return mlp


@oracles.needs("transformers")
def test_moe_layer_equals_transformers_gpt_oss_mlp():
    from megatron.checkpointing.hf import gpt_oss
    hf = _hf_mlp()
    sd = {f"model.layers.0.mlp.{n}": p.detach().clone() for n, p in hf.named_parameters()}
    ours = {}
    gpt_oss.experts_to_megatron(sd, "model.layers.0.", "", torch.float32, ours)
    layer = MoELayer(_cfg(), 1, ExpertGroups(), None, torch.float32).eval()
    layer.load_state_dict({n[len("mlp."):]: t for n, t in ours.items()}, strict=True)
    x = torch.randn(6, 2, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, _ = hf(x.transpose(0, 1))
        got, _ = layer(x)
        gate_up = torch.einsum("th,ehf->etf", x.reshape(-1, H), hf.experts.gate_up_proj)
    assert (gate_up > 7).any() and (gate_up < -7).any()  # both clamps in play
    rel = (got.transpose(0, 1) - want).abs().max() / want.abs().max()
    assert rel < 1e-5, rel
    back = {}
    gpt_oss.experts_to_hf({n: t.clone() for n, t in ours.items()}, "", "model.layers.0.", back)
    assert back.keys() == sd.keys() and all(torch.equal(back[n], sd[n]) for n in sd)


def test_clamped_quick_geglu_by_its_formula():
    from megatron.model.spec import mlp_activation
    x = torch.linspace(-12, 12, 40).view(2, 20)
    gate, up = x.chunk(2, dim=-1)
    g = gate.clamp(max=7.0)
    want = g * torch.sigmoid(1.702 * g) * (up.clamp(-7.0, 7.0) + 1)
    torch.testing.assert_close(mlp_activation(_cfg(moe=None))(x, None), want)
    plain = mlp_activation(_cfg(moe=None, glu_linear_offset=0.0,
                                activation_func_clamp_value=None))(x, None)
    torch.testing.assert_close(plain, gate * torch.sigmoid(1.702 * gate) * up)


def test_flags_reach_the_config():
    from megatron.arguments import parse_args
    from tests.gpt_setup import tiny_gpt_argv
    cfg = parse_args(tiny_gpt_argv("data", "cache", "--quick-geglu", "--glu-linear-offset", "1",
                                   "--activation-func-clamp-value", "7", "--num-experts", "4"),
                     world_size=1)[0]
    assert (cfg.model.activation, cfg.model.glu_linear_offset,
            cfg.model.activation_func_clamp_value) == ("quick_geglu", 1.0, 7.0)
    assert cfg.model.add_bias_linear  # Megatron's default: router and expert biases on


@pytest.mark.parametrize("changes,message", [
    (dict(activation="gelu", moe=None), "--glu-linear-offset 1.0 needs a gated activation"),
    (dict(activation_func_clamp_value=-1.0), "--activation-func-clamp-value must be positive"),
])
def test_bad_settings_are_one_line(changes, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(**changes)
