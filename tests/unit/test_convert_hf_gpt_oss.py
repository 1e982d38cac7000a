"""gpt-oss (GptOssForCausalLM) from Hugging Face and back.

A random 4-layer model (built in-process, nothing downloaded: sliding_attention with
window 8 and full_attention layers alternating, learned sinks, q/k/v/o, router and expert
biases, the clamped GLU, yarn with truncate=false, 4 experts top-2) converts to our
checkpoint; our model gives transformers' logits at 64 positions (max relative difference
< 1e-5) and its 32 greedy tokens with the KV cache (past the window); converting back
gives tensor-identical files with the same config, generation config and tokenizer files.
Its MXFP4 form (expert weights quantized here in transformers' layout: E2M1 codes, two a
byte, E8M0 scales per block of 32) imports as the dequantized tensors that transformers'
own dequantizer gives. A model trained here exports as GptOssForCausalLM by its config.
"""
import json
import os
import shutil

import pytest
import torch

from megatron.text_generation import generate
from tests import oracles
from tests.gpt_setup import one_thread
from tests.hf_models import (NEW_TOKENS, PROMPT_LEN, converted, hf_greedy, load_ours,
                             load_safetensors, position_ids, prompts, rel_err, save_hf_model,
                             save_word_tokenizer)
from tools import convert_checkpoint

pytestmark = oracles.needs("transformers")
GENERATION = {"bos_token_id": 5, "eos_token_id": [6, 7], "do_sample": True, "temperature": 0.6}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """(HF model, work dir with hf/ and ckpt_tp1_pp1/)."""
    work = str(tmp_path_factory.mktemp("gpt_oss"))
    hf_dir = os.path.join(work, "hf")
    model = save_hf_model("gpt_oss", hf_dir)
    with open(os.path.join(hf_dir, "generation_config.json"), "w") as f:
        json.dump(GENERATION, f)
    converted(work, "gpt_oss")
    return model, work


@pytest.fixture(scope="module")
def ours(family):
    hf_model, work = family
    with one_thread():
        models, tokenizer, _, config = load_ours(os.path.join(work, "ckpt_tp1_pp1"),
                                                 hf_model.config.vocab_size)
    return models[0], tokenizer, config


def test_config_has_both_attention_kinds_and_the_gpt_oss_features(ours):
    cfg = ours[2].model
    assert [cfg.window_for_layer(n) for n in range(1, 5)] == [8, None, 8, None]
    assert cfg.window_attn_skip_freq == 2 and cfg.softmax_type == "learnable"
    assert (cfg.activation, cfg.glu_linear_offset, cfg.activation_func_clamp_value) == \
        ("quick_geglu", 1.0, 7.0)
    assert cfg.add_bias_linear and cfg.rope_scaling_type == "yarn"
    assert not cfg.yarn_correction_range_round_to_int
    assert cfg.moe.num_experts == 4 and cfg.moe.moe_router_topk == 2


def test_logits_equal_transformers_at_64_positions(family, ours):
    hf_model, _ = family
    tokens = torch.randint(0, hf_model.config.vocab_size, (2, 64),
                           generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), one_thread():
        expected = hf_model(tokens).logits
        logits = ours[0](tokens, position_ids(tokens))
    assert rel_err(logits[..., :hf_model.config.vocab_size], expected) < 1e-5


def test_greedy_generation_equals_transformers(family, ours):
    hf_model, _ = family
    model, tokenizer, _ = ours
    prompt = prompts(hf_model.config.vocab_size)[:, :PROMPT_LEN]
    with one_thread():
        expected = hf_greedy(hf_model, prompt)
        got = generate(model, tokenizer, prompt.tolist(), NEW_TOKENS, greedy=True,
                       eod_stop=False, use_cache=True)
    assert got == expected and len(got[0]) == NEW_TOKENS


def test_round_trip_gives_identical_tensors_and_files(family, tmp_path):
    """With a tokenizer beside the weights: it travels and comes back, as the generation
    config does."""
    _, work = family
    shutil.copytree(os.path.join(work, "hf"), tmp_path / "hf")
    save_word_tokenizer(str(tmp_path / "hf"), 150)
    work, back = str(tmp_path), str(tmp_path / "back")
    converted(work, "gpt_oss")
    assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load",
                                    os.path.join(work, "ckpt_tp1_pp1"), "--save", back]) == 0
    assert sorted(os.listdir(back)) == sorted(os.listdir(os.path.join(work, "hf")))
    original = load_safetensors(os.path.join(work, "hf", "model.safetensors"))
    again = load_safetensors(os.path.join(back, "model.safetensors"))
    assert sorted(again) == sorted(original)
    for key, tensor in original.items():
        assert again[key].dtype == tensor.dtype and torch.equal(again[key], tensor), key
    for name in os.listdir(os.path.join(work, "hf")):
        if name.endswith(".json") or name.endswith(".txt"):
            with open(os.path.join(work, "hf", name)) as a, open(os.path.join(back, name)) as b:
                assert (json.load(a) == json.load(b)) if name.endswith(".json") else \
                    a.read() == b.read(), name


def test_model_trained_here_exports_as_gpt_oss(family, ours):
    from megatron.checkpointing.hf.families import hf_config_for
    from transformers import AutoConfig, AutoModelForCausalLM
    hf_model, _ = family
    vocab = hf_model.config.vocab_size
    arch, hf = hf_config_for(ours[2].model, vocab)
    assert arch == "GptOssForCausalLM"
    config = AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items()
                                                       if k != "model_type"})
    exported = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    exported.load_state_dict(hf_model.state_dict())
    tokens = prompts(vocab)
    with torch.no_grad(), one_thread():
        assert rel_err(exported(tokens).logits, hf_model(tokens).logits) < 1e-5


# -- MXFP4 -----------------------------------------------------------------------------
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def quantize_mxfp4(weight):
    """(blocks, scales) of an HF expert tensor [E, in, out] as the released checkpoints
    store it: rows are the `out` features, each cut into blocks of 32 inputs with an E8M0
    exponent (bias 127) and 16 bytes of E2M1 codes (the even element in the low nibble)."""
    rows = weight.transpose(1, 2)  # [E, out, in]
    e, out, cols = rows.shape
    x = rows.reshape(e, out, cols // 32, 32)
    exponent = torch.ceil(torch.log2(x.abs().amax(-1).clamp_min(1e-30) / 6.0)).clamp(-127, 127)
    codes = (x / torch.pow(2.0, exponent)[..., None])[..., None].sub(E2M1).abs().argmin(-1)
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def test_mxfp4_experts_are_dequantized_on_import(family, tmp_path):
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    _, work = family
    quantized = tmp_path / "mxfp4"
    shutil.copytree(os.path.join(work, "hf"), quantized)
    sd = load_safetensors(str(quantized / "model.safetensors"))
    expected = {}
    for name in [n for n in sd if n.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = quantize_mxfp4(sd.pop(name))
        sd[name + "_blocks"], sd[name + "_scales"] = blocks, scales
        expected[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(sd, str(quantized / "model.safetensors"))
    with open(quantized / "config.json") as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn"]}
    with open(quantized / "config.json", "w") as f:
        json.dump(config, f)
    ckpt = str(tmp_path / "ckpt")
    assert convert_checkpoint.main(["--from", "hf", "--to", "megatron", "--load",
                                    str(quantized), "--save", ckpt]) == 0
    back = str(tmp_path / "back")
    assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load", ckpt,
                                    "--save", back]) == 0
    again = load_safetensors(os.path.join(back, "model.safetensors"))
    for name, tensor in expected.items():
        assert torch.equal(again[name], tensor), name
        assert not torch.equal(tensor, load_safetensors(
            os.path.join(work, "hf", "model.safetensors"))[name])  # quantization rounded
    with open(os.path.join(back, "config.json")) as f:
        assert "quantization_config" not in json.load(f)
