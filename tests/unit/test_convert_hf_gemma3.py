"""Gemma 3 beyond what every family gets (test_convert_hf.py, test_hf_continue.py and
tests/distributed/test_convert_hf_layouts.py run the "gemma3" model of tests/hf_models.py:
sliding and full layers, local and global RoPE bases, linear scaling on the global layer):
the text part of Gemma3ForConditionalGeneration, the layer-type patterns, the defaults of a
partial text_config and the refusals, checked against `transformers` itself."""
import json

import pytest
import torch

from megatron.checkpointing.hf import gemma3
from tests import oracles
from tests.gpt_setup import one_thread
from tests.hf_models import (FAMILIES, check_multimodal_text_part, converted, load_ours,
                             perturb, position_ids, rel_err, save_hf_model)
from tools import convert_checkpoint

pytestmark = oracles.needs("transformers")


def test_defaults_are_transformers_gemma3_text_config():
    from transformers import Gemma3TextConfig
    reference = Gemma3TextConfig()
    for name, value in gemma3.DEFAULTS.items():
        assert getattr(reference, name) == value, name
    assert gemma3.THETAS == {"full_attention": reference.default_theta["global"],
                             "sliding_attention": reference.default_theta["local"]}


def _multimodal(directory: str):
    """A random Gemma3ForConditionalGeneration around the "gemma3" text model, saved."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig
    _, text = FAMILIES["gemma3"]()
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    config.text_config.bos_token_id = config.text_config.eos_token_id = None
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration._from_config(config, attn_implementation="eager",
                                                        dtype=torch.float32)
    perturb(model, 0)
    model.save_pretrained(directory, safe_serialization=True)
    return model.eval()


def test_text_part_of_the_multimodal_model(tmp_path, capsys):
    """Imported as its Gemma3ForCausalLM (said in one line); logits of its text-only forward;
    exported as a Gemma3ForCausalLM that transformers loads with the same logits."""
    back, tokens, expected = check_multimodal_text_part(
        _multimodal(str(tmp_path / "hf")), tmp_path, capsys, "Gemma3ForConditionalGeneration",
        "Gemma3ForCausalLM")
    from transformers import AutoModelForCausalLM
    text = AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager").eval()
    with torch.no_grad(), one_thread():
        assert rel_err(text(tokens).logits, expected) < 1e-5


def test_logits_at_64_positions(tmp_path):
    """64 positions, eight times the sliding layers' window (the shared tests use 40)."""
    model = save_hf_model("gemma3", str(tmp_path / "hf"))
    ckpt = converted(str(tmp_path), "gemma3")
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), one_thread():
        ours = load_ours(ckpt, vocab)[0][0]
        assert rel_err(ours(tokens, position_ids(tokens))[..., :vocab],
                       model(tokens).logits) < 1e-5


@pytest.mark.parametrize("types, expected", [
    ("SSSSSF" * 2, 6), ("SSSSSFSS", 6), ("SF" * 3, 2), ("SFSS", [1, 0, 1, 1]),
    ("FSSS", 1 * [0] + 3 * [1])])
def test_layer_types_as_window_attn_skip_freq(types, expected):
    names = {"S": "sliding_attention", "F": "full_attention"}
    assert gemma3._skip_freq([names[t] for t in types]) == expected


def test_old_config_keys_give_the_same_fields():
    """sliding_window_pattern, rope_theta, rope_local_base_freq and rope_scaling (configs
    written before transformers 5) read as layer_types and rope_parameters."""
    _, config = FAMILIES["gemma3"]()
    new = config.to_dict()
    old = {k: v for k, v in new.items() if k not in ("layer_types", "rope_parameters")}
    old.update(sliding_window_pattern=4, rope_theta=1e6, rope_local_base_freq=1e4,
               rope_scaling={"rope_type": "linear", "factor": 8.0})
    fields = gemma3.model_fields(new)
    assert gemma3.model_fields(old) == fields
    assert (fields["window_size"], fields["window_attn_skip_freq"], fields["rotary_base"],
            fields["rotary_base_local"], fields["rotary_seq_len_interpolation_factor"],
            fields["rope_scaling_local"]) == (8, 4, 1000000, 10000, 8.0, False)
    assert fields["softmax_scale"] == 24 ** -0.5


@pytest.mark.parametrize("changes, words", [
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0 is not supported"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0 is not supported"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    (dict(layer_types=["sliding_attention"] * 3), "layer_types has 3 entries for 4 layers"),
])
def test_refusals_are_one_line(tmp_path, capsys, changes, words):
    hf = tmp_path / "hf"
    save_hf_model("gemma3", str(hf))
    config = json.loads((hf / "config.json").read_text())
    config.update(changes)
    (hf / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # transformers' progress bar of the save
    code = convert_checkpoint.main(["--from", "hf", "--to", "megatron", "--load", str(hf),
                                    "--save", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_published_12b_config_is_the_preset(tmp_path):
    """The text_config of Gemma 3 12B's published config.json (partial: the rest are
    Gemma3TextConfig's defaults) gives examples/pretrain_gemma3_12b.sh's architecture."""
    from megatron.config import ModelConfig
    from megatron.config.model import ARCHITECTURE_FIELDS
    from tests.unit.test_examples import parsed_launch
    published = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                 "text_config": {"hidden_size": 3840, "intermediate_size": 15360,
                                 "model_type": "gemma3_text", "num_attention_heads": 16,
                                 "num_hidden_layers": 48, "num_key_value_heads": 8,
                                 "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                 "sliding_window": 1024}}
    arch, text, _ = gemma3.text_part("Gemma3ForConditionalGeneration", published)
    imported = ModelConfig(**gemma3.model_fields(text, 8192))
    preset, _ = parsed_launch(tmp_path, "pretrain_gemma3_12b.sh")
    assert arch == "Gemma3ForCausalLM"
    for name in ARCHITECTURE_FIELDS:
        assert getattr(imported, name) == getattr(preset.model, name), name
    assert text["vocab_size"] == 262208
