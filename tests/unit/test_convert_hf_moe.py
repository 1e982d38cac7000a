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

pytest.importorskip("transformers")

from megatron.text_generation import generate  # noqa: E402
from tests.gpt_setup import one_thread  # noqa: E402
from tests.hf_models import (MOE_FAMILIES, NEW_TOKENS, PROMPT_LEN, converted_family,  # noqa: E402
                             hf_greedy, load_converted, position_ids, prompts, rel_err,
                             round_trip)


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
    its architecture from our config alone: Mixtral's comes back as MixtralForCausalLM with
    the original's logits; a shared expert or dense layers have no exported architecture
    and are refused, naming the field (a dense family never takes an MoE model)."""
    from megatron.checkpointing.hf import ConversionError
    from megatron.checkpointing.hf.families import hf_config_for
    from transformers import AutoConfig, AutoModelForCausalLM
    name, hf_model, _ = family
    cfg, vocab = ours[2].model, hf_model.config.vocab_size
    if name != "mixtral":
        with pytest.raises(ConversionError, match="cannot be expressed in MixtralForCausalLM"):
            hf_config_for(cfg, vocab)
        return
    arch, hf = hf_config_for(cfg, vocab)
    assert arch == "MixtralForCausalLM"
    config = AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items()
                                                       if k != "model_type"})
    exported = AutoModelForCausalLM.from_config(config).eval()
    exported.load_state_dict(hf_model.state_dict())
    tokens = prompts(vocab)
    with torch.no_grad(), one_thread():
        assert rel_err(exported(tokens).logits, hf_model(tokens).logits) < 1e-5
