"""Mixtral, Qwen2-MoE and Qwen3-MoE from Hugging Face and back.

A small random model of each (built in-process, nothing downloaded; Qwen2-MoE with a
gated shared expert and a dense layer, Qwen3-MoE with q/k norms and renormalised
top-k) converts to our checkpoint; our model gives transformers' logits (max
relative difference < 1e-5) and its 32 greedy tokens, and converting back gives
tensor-identical files.
"""
import json
import os

import pytest
import torch

from megatron.text_generation import generate
from tests import oracles
from tests.gpt_setup import one_thread
from tests.hf_models import (MOE_FAMILIES, NEW_TOKENS, PROMPT_LEN, converted_family,
                             hf_greedy, load_converted, position_ids, prompts, rel_err,
                             round_trip)

pytestmark = oracles.needs("transformers")


@pytest.fixture(scope="module", params=sorted(MOE_FAMILIES))
def family(request, tmp_path_factory):
    return converted_family(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def ours(family):
    models, tokenizer, _, config = load_converted(family)
    return models[0], tokenizer, config


def test_moe_config_is_read(family, ours):
    name, hf_model, _ = family
    moe = ours[2].model.moe
    assert moe.num_experts == {"mixtral": 4, "qwen2_moe": 4, "qwen3_moe": 8}[name]
    if name == "qwen2_moe":
        assert moe.layer_pattern(4) == [1, 0, 1, 1] and moe.moe_shared_expert_gate
        assert moe.moe_router_pre_softmax  # norm_topk_prob False
    if name == "qwen3_moe":
        assert ours[2].model.qk_layernorm and not moe.moe_router_pre_softmax


def test_logits_equal_transformers(family, ours):
    _, hf_model, _ = family
    model = ours[0]
    tokens = prompts(hf_model.config.vocab_size)
    with torch.no_grad(), one_thread():
        expected = hf_model(tokens).logits
        logits = model(tokens, position_ids(tokens))
    vocab = hf_model.config.vocab_size
    assert rel_err(logits[..., :vocab], expected) < 1e-5


def test_greedy_generation_equals_transformers(family, ours):
    _, hf_model, _ = family
    model, tokenizer, _ = ours
    prompt = prompts(hf_model.config.vocab_size)[:, :PROMPT_LEN]
    with one_thread():
        expected = hf_greedy(hf_model, prompt)
        got = generate(model, tokenizer, prompt.tolist(), NEW_TOKENS, greedy=True,
                       eod_stop=False, use_cache=True)
    assert got == expected


def test_round_trip_gives_identical_tensors(family, tmp_path):
    work = family[2]
    back = str(tmp_path / "back")
    original, again = round_trip(family, back)
    for key, tensor in original.items():
        assert torch.equal(again[key], tensor), key
    with open(os.path.join(work, "hf", "config.json")) as a, \
            open(os.path.join(back, "config.json")) as b:
        assert json.load(a) == json.load(b)


def test_model_trained_here_is_exported_by_its_own_config(family, ours):
    """The export of an MoE model that carries no HF entry (trained here from flags) takes
    its architecture from our config alone: each family comes back as its own architecture
    with the original's logits (Qwen2-MoE's dense layer as mlp_only_layers)."""
    from megatron.checkpointing.hf.families import hf_config_for
    from transformers import AutoConfig, AutoModelForCausalLM
    _, hf_model, _ = family
    cfg, vocab = ours[2].model, hf_model.config.vocab_size
    arch, hf = hf_config_for(cfg, vocab)
    assert arch == hf_model.config.architectures[0]
    config = AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items()
                                                       if k != "model_type"})
    exported = AutoModelForCausalLM.from_config(config).eval()
    exported.load_state_dict(hf_model.state_dict())
    tokens = prompts(vocab)
    with torch.no_grad(), one_thread():
        assert rel_err(exported(tokens).logits, hf_model(tokens).logits) < 1e-5


@pytest.mark.parametrize("change, words", [
    (dict(moe_shared_expert_gate=False), "moe_shared_expert_gate=False cannot be expressed in "
                                         "Qwen2MoeForCausalLM (it would be True)"),
    (dict(moe_router_score_function="sigmoid"), "moe_router_score_function=sigmoid cannot be "
                                                "expressed in Qwen2MoeForCausalLM"),
])
def test_moe_model_no_architecture_expresses_is_refused(change, words):
    """A shared expert without Qwen2-MoE's gate, or sigmoid routing, has no HF architecture:
    one line naming the field (never a dense family's complaint about the MLP)."""
    import dataclasses
    from megatron.checkpointing.hf import ConversionError
    from megatron.checkpointing.hf.families import hf_config_for
    from megatron.config import ModelConfig, MoEConfig
    moe = MoEConfig(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                    moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True)
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16,
                      max_position_embeddings=16, padded_vocab_size=128, ffn_hidden_size=96,
                      position_embedding_type="rope", normalization="RMSNorm",
                      activation="swiglu", add_bias_linear=False, add_qkv_bias=True,
                      untie_embeddings_and_output_weights=True, moe=moe)
    hf_config_for(cfg, 128)  # Qwen2-MoE expresses it as it is
    if "moe_shared_expert_gate" not in change:
        moe = dataclasses.replace(moe, moe_shared_expert_intermediate_size=None,
                                  moe_shared_expert_gate=False)
    with pytest.raises(ConversionError, match=words.replace("(", r"\(").replace(")", r"\)")):
        hf_config_for(dataclasses.replace(cfg, moe=dataclasses.replace(moe, **change)), 128)


def test_dense_model_no_architecture_expresses_is_refused():
    from megatron.checkpointing.hf import ConversionError
    from megatron.checkpointing.hf.families import hf_config_for
    from megatron.config import ModelConfig
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16,
                      max_position_embeddings=16, padded_vocab_size=128,
                      position_embedding_type="rope", normalization="LayerNorm")
    with pytest.raises(ConversionError, match="normalization=LayerNorm cannot be expressed in "
                                              "LlamaForCausalLM"):
        hf_config_for(cfg, 128)
