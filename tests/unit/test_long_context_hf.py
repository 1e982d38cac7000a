"""Sliding-window attention and the llama3 / yarn RoPE scalings, against `transformers`.

A Mistral whose sliding_window is shorter than the sequence, and LLaMAs whose
rope_scaling is llama3 or yarn with an original context shorter than the sequence:
converted models give transformers' logits at every position and its greedy tokens
well past the window / original context (our KV cache), and convert back to
identical tensors and config. Models trained here export with the same fields.
"""
import json
import os

import pytest
import torch

from megatron.text_generation import generate
from tests import oracles
from tests.gpt_setup import one_thread
from tests.hf_models import (converted, load_ours, load_safetensors, position_ids, rel_err,
                             save_hf_model)
from tools import convert_checkpoint

pytestmark = oracles.needs("transformers")

WINDOW, PROMPT, PAST = 16, 8, 48
NEW = WINDOW - PROMPT + PAST  # the last PAST tokens are generated past the window
VARIANTS = {
    "mistral-window": ("mistral", {"sliding_window": WINDOW}),
    "llama3": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": WINDOW, "rope_theta": 500000.0}}),
    "yarn": ("llama", {"rope_parameters": {
        "rope_type": "yarn", "factor": 6.0, "original_max_position_embeddings": WINDOW,
        "rope_theta": 10000.0}}),
    # gpt-oss's: the ramp's ends not rounded (--no-yarn-correction-range-round-to-int)
    "yarn-no-truncate": ("llama", {"rope_parameters": {
        "rope_type": "yarn", "factor": 6.0, "original_max_position_embeddings": WINDOW,
        "rope_theta": 10000.0, "truncate": False, "beta_fast": 8.0, "beta_slow": 0.5}}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    """(HF model, work dir with hf/ and its conversion, our model, tokenizer)."""
    family, overrides = VARIANTS[request.param]
    work = str(tmp_path_factory.mktemp(request.param))
    hf_model = save_hf_model(family, os.path.join(work, "hf"), **overrides)
    ckpt = converted(work, family)
    with one_thread():
        models, tokenizer, _, _ = load_ours(ckpt, hf_model.config.vocab_size)
    return hf_model, work, models[0], tokenizer


def _tokens(vocab, length):
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(3))


def test_logits_equal_transformers_at_every_position(variant):
    hf_model, _, model, _ = variant
    vocab = hf_model.config.vocab_size
    tokens = _tokens(vocab, PROMPT + NEW)
    with torch.no_grad(), one_thread():
        expected = hf_model(tokens).logits
        logits = model(tokens, position_ids(tokens))[..., :vocab]
    worst = max(rel_err(logits[:, i], expected[:, i]) for i in range(tokens.shape[1]))
    assert worst < 1e-5, worst
    print(f"{type(hf_model).__name__} {hf_model.config.rope_parameters.get('rope_type')} "
          f"window {getattr(hf_model.config, 'sliding_window', None)}: max relative logits "
          f"difference {worst:.2e} over {tokens.shape[1]} positions")
    plain = _without_window_or_scaling(hf_model)  # what the comparison would miss
    with torch.no_grad(), one_thread():
        assert rel_err(plain(tokens).logits[:, -1], expected[:, -1]) > 1e-3


def _without_window_or_scaling(hf_model):
    config = hf_model.config.__class__(**hf_model.config.to_dict())
    config.sliding_window = None
    config.rope_parameters = {"rope_type": "default",
                              "rope_theta": hf_model.config.rope_parameters["rope_theta"]}
    plain = type(hf_model)._from_config(config, attn_implementation="eager", dtype=torch.float32)
    plain.load_state_dict(hf_model.state_dict())
    return plain.eval()


def test_greedy_tokens_past_the_window_equal_transformers(variant):
    hf_model, _, model, tokenizer = variant
    prompt = _tokens(hf_model.config.vocab_size, PROMPT)
    with one_thread():
        expected = hf_model.generate(prompt, do_sample=False, max_new_tokens=NEW,
                                     min_new_tokens=NEW, attention_mask=torch.ones_like(prompt))
        got = generate(model, tokenizer, prompt.tolist(), NEW, greedy=True, eod_stop=False,
                       use_cache=True)
    assert got == expected[:, PROMPT:].tolist()
    assert len(got[0]) - (WINDOW - PROMPT) == PAST


def test_round_trip_is_identical(variant, tmp_path):
    _, work, _, _ = variant
    back = str(tmp_path / "back")
    assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load",
                                    os.path.join(work, "ckpt_tp1_pp1"), "--save", back]) == 0
    original = load_safetensors(os.path.join(work, "hf", "model.safetensors"))
    again = load_safetensors(os.path.join(back, "model.safetensors"))
    assert sorted(again) == sorted(original)
    assert all(torch.equal(again[k], t) for k, t in original.items())
    with open(os.path.join(work, "hf", "config.json")) as a, \
            open(os.path.join(back, "config.json")) as b:
        assert json.load(a) == json.load(b)


def test_model_trained_here_exports_its_window_and_scaling(variant):
    """The HF config derived from our config alone describes the same model, and
    transformers builds it with the original's logits."""
    from megatron.checkpointing.hf.families import hf_config_for
    from transformers import AutoConfig, AutoModelForCausalLM
    hf_model, _, model, _ = variant
    vocab = hf_model.config.vocab_size
    arch, hf = hf_config_for(model.cfg, vocab)
    config = AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items()
                                                       if k != "model_type"})
    exported = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    exported.load_state_dict(hf_model.state_dict())
    tokens = _tokens(vocab, PROMPT + NEW)
    with torch.no_grad(), one_thread():
        assert rel_err(exported(tokens).logits, hf_model(tokens).logits) < 1e-5
    assert arch == type(hf_model).__name__ or arch == "LlamaForCausalLM"


@pytest.mark.parametrize("overrides, message", [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     "rope scaling 'dynamic' is not supported"),
])
def test_unsupported_scalings_are_one_line(tmp_path, capsys, overrides, message):
    save_hf_model("llama", str(tmp_path / "hf"), **overrides)
    capsys.readouterr()
    code = convert_checkpoint.main(["--from", "hf", "--to", "megatron", "--load",
                                    str(tmp_path / "hf"), "--save", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
