"""Llama 4 (Llama4ForCausalLM) from Hugging Face and back.

A random 4-layer model (built in-process, nothing downloaded; tests/hf_models.py's
"llama4": chunked attention of 16 positions on RoPE layers 1-3, layer 4 NoPE with
attention temperature tuning at floor_scale 8, q / k L2 norm, interleaved RoPE with llama3
scaling, dense layers 1 and 3 of intermediate_size_mlp, MoE layers 2 and 4 with 4 experts
top-1 and a shared expert) converts to our checkpoint; our model gives transformers'
logits at 64 positions (four chunks; max relative difference < 1e-5) and its 32 greedy
tokens with the KV cache (past two chunk boundaries); converting back gives
tensor-identical files with the same config; a model trained here exports as
Llama4ForCausalLM, which transformers loads with the same logits; the text part of
Llama4ForConditionalGeneration imports with one line about the vision tower; bad settings
are one line and exit 2. (TP 2 x EP 2: tests/distributed/test_convert_hf_moe_families_layouts.py.)
"""
import json
import os
import shutil

import pytest
import torch

from megatron.checkpointing.hf import llama4
from megatron.text_generation import generate
from tests import oracles
from tests.gpt_setup import one_thread
from tests.hf_models import (NEW_TOKENS, PROMPT_LEN, check_multimodal_text_part, converted,
                             converted_family, hf_greedy, load_converted, load_ours,
                             load_safetensors, perturb, position_ids, prompts, rel_err,
                             save_hf_model, save_word_tokenizer)
from tools import convert_checkpoint

pytestmark = oracles.needs("transformers")


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """(HF model, work dir with hf/ and ckpt_tp1_pp1/)."""
    return converted_family("llama4", tmp_path_factory)[1:]


@pytest.fixture(scope="module")
def ours(family):
    models, tokenizer, _, config = load_converted(("llama4", *family))
    return models[0], tokenizer, config


def test_config_has_every_layer_kind(ours):
    cfg = ours[2].model
    assert [cfg.uses_rope(n) for n in range(1, 5)] == [True, True, True, False]
    assert [cfg.chunk_for_layer(n) for n in range(1, 5)] == [16, 16, 16, None]
    assert [cfg.temperature_for_layer(n) for n in range(1, 5)] == [False] * 3 + [True]
    assert [cfg.l2_norm_for_layer(n) for n in range(1, 5)] == [True] * 3 + [False]
    assert [cfg.is_moe_layer(n) for n in range(1, 5)] == [False, True, False, True]
    assert cfg.rotary_interleaved and cfg.rope_scaling_type == "llama3"
    assert (cfg.attn_temperature_floor_scale, cfg.attn_temperature_scale) == (8, 0.1)
    moe = cfg.moe
    assert (moe.num_experts, moe.moe_router_topk, moe.moe_router_score_function) == \
        (4, 1, "sigmoid")
    assert moe.moe_apply_probs_on_input and moe.moe_shared_expert_intermediate_size == 32
    assert (cfg.ffn_hidden_size, moe.moe_ffn_hidden_size) == (96, 32)


@pytest.mark.parametrize("length", [64, 56])  # four whole chunks (folded), and a mask
def test_logits_equal_transformers(family, ours, length):
    hf_model, _ = family
    tokens = torch.randint(0, hf_model.config.vocab_size, (2, length),
                           generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), one_thread():
        expected = hf_model(tokens).logits
        logits = ours[0](tokens, position_ids(tokens))
    assert rel_err(logits[..., :hf_model.config.vocab_size], expected) < 1e-5


@pytest.mark.parametrize("impl", ["sdpa", "torch"])
def test_every_attention_path_gives_the_logits(family, impl):
    """--attention-impl sdpa and torch (the explicit softmax), chunks folded (64) and masked
    (56); auto (our CPU kernel where measured faster) is the test above."""
    hf_model, work = family
    vocab = hf_model.config.vocab_size
    with one_thread():
        model = load_ours(os.path.join(work, "ckpt_tp1_pp1"), vocab,
                          extra=("--attention-impl", impl))[0][0]
    for length in (64, 56):
        tokens = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(6))
        with torch.no_grad(), one_thread():
            logits = model(tokens, position_ids(tokens))[..., :vocab]
            assert rel_err(logits, hf_model(tokens).logits) < 1e-5, (impl, length)


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
    _, work = family
    shutil.copytree(os.path.join(work, "hf"), tmp_path / "hf")
    save_word_tokenizer(str(tmp_path / "hf"), 150)
    work, back = str(tmp_path), str(tmp_path / "back")
    converted(work, "llama4")
    assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load",
                                    os.path.join(work, "ckpt_tp1_pp1"), "--save", back]) == 0
    original = load_safetensors(os.path.join(work, "hf", "model.safetensors"))
    again = load_safetensors(os.path.join(back, "model.safetensors"))
    assert sorted(again) == sorted(original)
    for key, tensor in original.items():
        assert again[key].dtype == tensor.dtype and torch.equal(again[key], tensor), key
    for name in os.listdir(os.path.join(work, "hf")):
        if name.endswith(".json"):
            with open(os.path.join(work, "hf", name)) as a, open(os.path.join(back, name)) as b:
                assert json.load(a) == json.load(b), name


def test_model_trained_here_exports_as_llama4(family, ours):
    """The config derived from ours (no stored HF config) carries every Llama 4 field:
    transformers builds the same model from it."""
    from megatron.checkpointing.hf.families import hf_config_for
    from transformers import AutoConfig, AutoModelForCausalLM
    hf_model, _ = family
    vocab = hf_model.config.vocab_size
    arch, hf = hf_config_for(ours[2].model, vocab)
    assert arch == "Llama4ForCausalLM"
    reference = hf_model.config.to_dict()
    for name in ("no_rope_layers", "attention_chunk_size", "use_qk_norm", "attn_temperature_tuning",
                 "floor_scale", "attn_scale", "moe_layers", "num_local_experts",
                 "num_experts_per_tok", "intermediate_size", "intermediate_size_mlp",
                 "rope_parameters", "tie_word_embeddings", "layer_types"):
        assert hf[name] == reference[name], name
    config = AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items()
                                                       if k != "model_type"})
    exported = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    exported.load_state_dict(hf_model.state_dict())
    tokens = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), one_thread():
        assert rel_err(exported(tokens).logits, hf_model(tokens).logits) < 1e-5


def test_export_loads_in_transformers_with_our_logits(family, ours, tmp_path):
    hf_model, work = family
    back = str(tmp_path / "back")
    assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load",
                                    os.path.join(work, "ckpt_tp1_pp1"), "--save", back]) == 0
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager").eval()
    assert type(loaded).__name__ == "Llama4ForCausalLM"
    vocab = hf_model.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), one_thread():
        logits = ours[0](tokens, position_ids(tokens))[..., :vocab]
        assert rel_err(logits, loaded(tokens).logits) < 1e-5


def test_defaults_are_transformers_llama4_text_config():
    from transformers import Llama4TextConfig
    reference = Llama4TextConfig()
    for name, value in llama4.DEFAULTS.items():
        if name == "rope_theta":
            assert reference.rope_parameters["rope_theta"] == value
        else:
            assert getattr(reference, name) == value, name


def _multimodal(directory: str):
    """A random Llama4ForConditionalGeneration around the "llama4" text model, saved."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration, Llama4VisionConfig
    from tests.hf_models import OTHER_FAMILIES
    _, text = OTHER_FAMILIES["llama4"]()
    vision = Llama4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14,
                                vision_output_dim=32, projector_input_dim=32,
                                projector_output_dim=32)
    config = Llama4Config(text_config=text.to_dict(), vision_config=vision.to_dict())
    config.text_config.bos_token_id = config.text_config.eos_token_id = None
    torch.manual_seed(0)
    model = Llama4ForConditionalGeneration._from_config(config, attn_implementation="eager",
                                                        dtype=torch.float32)
    perturb(model, 0)
    model.save_pretrained(directory, safe_serialization=True)
    return model.eval()


def test_text_part_of_the_multimodal_model(tmp_path, capsys):
    check_multimodal_text_part(_multimodal(str(tmp_path / "hf")), tmp_path, capsys,
                               "Llama4ForConditionalGeneration", "Llama4ForCausalLM")


@pytest.mark.parametrize("changes, words", [
    (dict(num_experts_per_tok=2), "num_experts_per_tok=2 is not supported"),
    (dict(attention_bias=True), "attention_bias=True is not supported"),
    (dict(layer_types=["full_attention"] * 4), "layer_types"),
])
def test_conversion_refusals_are_one_line(tmp_path, capsys, changes, words):
    hf = tmp_path / "hf"
    save_hf_model("llama4", str(hf))
    config = json.loads((hf / "config.json").read_text())
    config.update(changes)
    (hf / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    code = convert_checkpoint.main(["--from", "hf", "--to", "megatron", "--load", str(hf),
                                    "--save", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
        "--position-embedding-type", "rope", "--train-iters", "1", "--lr", "1e-3"]


@pytest.mark.parametrize("flags, words", [
    (["--attention-chunk-size", "16", "--context-parallel-size", "2", "--cp-comm-type", "p2p"],
     "--attention-chunk-size 16 with --cp-comm-type p2p is not supported"),
    (["--qk-l2-norm", "--qk-layernorm"], "--qk-l2-norm and --qk-layernorm"),
    (["--attention-chunk-size", "0"], "--attention-chunk-size must be a positive"),
    (["--attention-chunk-size", "16", "--window-size", "8"], "choose one"),
    (["--rotary-interleaved", "--position-embedding-type", "learned_absolute"],
     "--rotary-interleaved needs --position-embedding-type rope"),
    (["--attn-temperature-tuning", "--attn-temperature-floor-scale", "0"],
     "--attn-temperature-floor-scale must be positive"),
    (["--num-experts", "4", "--moe-router-topk", "2", "--moe-apply-probs-on-input"],
     "--moe-apply-probs-on-input needs --moe-router-topk 1"),
])
def test_bad_settings_are_one_line_exit_2(capsys, flags, words):
    from megatron.arguments import parse_args
    with pytest.raises(SystemExit) as exit_info:
        parse_args(BASE + flags, world_size=2 if "--context-parallel-size" in flags else 1)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_scout_config_is_the_preset(tmp_path):
    """Llama4TextConfig's defaults (Scout's sizes) with the RoPE scaling and positions the
    preset takes from Scout's config.json, imported as the text of a multimodal config,
    give examples/pretrain_llama4_scout.sh's architecture, MoE included."""
    from megatron.config import ModelConfig
    from megatron.config.model import ARCHITECTURE_FIELDS, SCALING_FIELDS
    from megatron.config.moe import ARCHITECTURE_FIELDS as MOE_FIELDS
    from tests.unit.test_examples import parsed_launch
    published = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
                 "text_config": {"model_type": "llama4_text",
                                 "max_position_embeddings": 10485760,
                                 "rope_scaling": {"rope_type": "llama3", "factor": 16.0,
                                                  "low_freq_factor": 1.0,
                                                  "high_freq_factor": 1.0,
                                                  "original_max_position_embeddings": 8192}}}
    arch, text, _ = llama4.text_part("Llama4ForConditionalGeneration", published)
    imported = ModelConfig(**llama4.model_fields(text, 8192))
    preset, _ = parsed_launch(tmp_path, "pretrain_llama4_scout.sh")
    assert arch == "Llama4ForCausalLM"
    for name in ARCHITECTURE_FIELDS + SCALING_FIELDS["llama3"] + ("max_position_embeddings",):
        assert getattr(imported, name) == getattr(preset.model, name), name
    for name in MOE_FIELDS + ("moe_ffn_hidden_size", "moe_layer_freq"):
        assert getattr(imported.moe, name) == getattr(preset.model.moe, name), name
    assert text["vocab_size"] == 202048
