"""Hugging Face <-> Megatron conversion, checked against `transformers` itself.

Small random HF models of each family (tests/hf_models.py) are saved with
safetensors, converted with tools/convert_checkpoint.py and loaded through the
entry points' loading path; logits and greedy generation (our KV cache) must
equal transformers', and HF -> ours -> HF must give identical tensors.
"""
import json
import os

import pytest
import torch

from megatron.text_generation import generate
from megatron.checkpointing.io import save_file
from tests import oracles
from tests.gpt_setup import one_thread
from tests.hf_models import (converted, converted_family, FAMILIES, hf_greedy, load_converted,
                             load_ours, load_safetensors, NEW_TOKENS, position_ids, PROMPT_LEN,
                             prompts, rel_err, round_trip, save_hf_model)
from megatron.checkpointing.megatron_legacy import safe_load
from tools import convert_checkpoint

pytestmark = oracles.needs("transformers")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    return converted_family(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def ours(family):
    models, tokenizer, _, _ = load_converted(family)
    return models[0], tokenizer


def test_logits_equal_transformers(family, ours):
    _, hf_model, _ = family
    model, _ = ours
    tokens = prompts(hf_model.config.vocab_size)
    with torch.no_grad(), one_thread():
        expected = hf_model(tokens).logits
        logits = model(tokens, position_ids(tokens))
    vocab = hf_model.config.vocab_size
    assert logits.shape[-1] > vocab  # the padding rows exist ...
    assert rel_err(logits[..., :vocab], expected) < 1e-5
    assert torch.all(logits[..., vocab:] == 0)  # ... and are zero rows


def test_greedy_generation_with_kv_cache_equals_transformers(family, ours):
    _, hf_model, _ = family
    model, tokenizer = ours
    assert tokenizer.vocab_size == hf_model.config.vocab_size
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
        assert again[key].dtype == tensor.dtype and torch.equal(again[key], tensor), key
    for extra in ("config.json", "generation_config.json"):
        with open(os.path.join(work, "hf", extra)) as a, open(os.path.join(back, extra)) as b:
            assert json.load(a) == json.load(b)


@pytest.fixture(scope="module")
def small_dirs(tmp_path_factory):
    """Saved GPT-2 and LLaMA directories whose config.json the error tests edit copies of."""
    root = tmp_path_factory.mktemp("small")
    for name in ("gpt2", "llama"):
        save_hf_model(name, str(root / name))
    return root


def _edited(small_dirs, tmp_path, name, **changes):
    import shutil
    target = tmp_path / f"{name}_edited"
    shutil.copytree(small_dirs / name, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return str(target)


@pytest.mark.parametrize("name, changes, extra, message", [
    ("gpt2", {"architectures": ["OPTForCausalLM"]}, [], "is not supported"),
    ("gpt2", {}, ["--pad-vocab-size-to", "200"], "does not fit"),
    ("gpt2", {}, ["--pad-vocab-size-to", "255", "--target-tensor-model-parallel-size", "2"],
     "not divisible"),
    ("gpt2", {"activation_function": "relu"}, [], "activation_function"),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, [], "rope scaling"),
    ("llama", {"attention_bias": True}, [], "attention_bias"),
    ("llama", {"hidden_act": "gelu"}, [], "hidden_act"),
    ("llama", {}, ["--seq-length", "1000"], "--seq-length 1000"),
    ("llama", {}, ["--target-tensor-model-parallel-size", "8"], "--num-attention-heads (4)"),
    ("gpt2", {}, ["--target-pipeline-model-parallel-size", "3"], "--num-layers (2)"),
])
def test_conversion_errors_are_one_line(small_dirs, tmp_path, capsys, name, changes, extra,
                                        message):
    source = _edited(small_dirs, tmp_path, name, **changes)
    save = tmp_path / "out"
    code = convert_checkpoint.main(["--from", "hf", "--to", "megatron", "--load", source,
                                    "--save", str(save), *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not save.exists()


def test_megatron_to_hf_needs_a_converted_checkpoint(tmp_path, capsys):
    code = convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load",
                                    str(tmp_path), "--save", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert code == 2 and "latest_checkpointed_iteration.txt" in err and err.count("\n") == 1


def test_linear_rope_scaling_maps_to_interpolation_factor():
    from megatron.checkpointing.hf import llama
    from tests.hf_models import build_hf_model
    hf = build_hf_model("llama").config.to_dict()
    hf["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    fields = llama.model_fields(hf)
    assert fields["rotary_seq_len_interpolation_factor"] == 4.0
    assert fields["rotary_base"] == 500000


def test_padding_rows_never_win_generation_or_lambada(tmp_path):
    """A GPT-2 whose real logits are all negative: the zero padding rows' logit 0 is the
    raw maximum, yet greedy generation picks what transformers picks, and LAMBADA's
    scoring counts transformers' argmax as correct."""
    from tasks.zeroshot_gpt.evaluate import LAMBADA, score
    from tests.hf_models import build_hf_model
    model = build_hf_model("gpt2")
    with torch.no_grad():
        wte = model.transformer.wte.weight
        wte[:, 0] = wte[:, 0].abs() + 0.5
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.zero_()
        model.transformer.ln_f.bias[0] = -5.0
    model.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    ckpt = converted(str(tmp_path), "gpt2")
    vocab = model.config.vocab_size
    prompt = prompts(vocab)[:, :PROMPT_LEN]
    with one_thread():
        models, tokenizer, _, _ = load_ours(ckpt, vocab)
        with torch.no_grad():
            raw = models[0](prompt, position_ids(prompt))
        got = generate(models[0], tokenizer, prompt.tolist(), NEW_TOKENS, greedy=True,
                       eod_stop=False)
        expected = hf_greedy(model, prompt)
    assert bool((raw.argmax(-1) >= vocab).all())  # unmasked, a padding id would win
    assert got == expected and max(max(row) for row in got) < vocab
    with torch.no_grad():
        labels = model(prompt).logits.argmax(-1)
    batch = {"labels": labels, "loss_mask": torch.ones_like(labels), "valid": torch.ones(2)}
    assert float(score(LAMBADA, batch, raw, vocab_size=vocab)[0]) == 2.0
    assert float(score(LAMBADA, batch, raw)[0]) == 0.0


LLAMA_FLAGS = ["--position-embedding-type", "rope", "--rotary-base", "500000",
               "--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--swiglu",
               "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "96",
               "--untie-embeddings-and-output-weights", "--disable-bias-linear"]


def test_pretrain_gpt_loads_a_converted_checkpoint(tmp_path):
    """pretrain_gpt.py --load takes the converted release checkpoint with the LLaMA flags
    (the preset's, scaled down) and starts from its weights at iteration 0: one step at
    warm-up lr 0 saves them unchanged. The trained checkpoint (no "hf" entry, a GPT-2
    BPE tokenizer of 8000 ids) exports to an HF model with the original's logits."""
    import pretrain_gpt
    from megatron.checkpointing.model_file import from_megatron_layout
    from tests.gpt_setup import preprocess_wiki, tiny_gpt_argv
    hf_model = save_hf_model("llama", str(tmp_path / "hf"), vocab_size=8000)
    ckpt = converted(str(tmp_path), "llama")
    prefix = preprocess_wiki(tmp_path, docs=20)
    argv = tiny_gpt_argv(prefix, tmp_path / "cache", *LLAMA_FLAGS, "--load", ckpt,
                         "--save", str(tmp_path / "trained"), "--lr-warmup-iters", "1",
                         "--save-interval", "1", layers=2, hidden=64, heads=4, seq=32, iters=1)
    argv.remove("--lr-warmup-fraction")
    argv.remove("0.1")
    with one_thread():
        pretrain_gpt.main(argv)

    def weights(root, directory):
        path = os.path.join(root, directory, "mp_rank_00", "model_optim_rng.pt")
        return from_megatron_layout(safe_load(path)["model"])
    before, after = weights(ckpt, "release"), weights(str(tmp_path / "trained"), "iter_0000001")
    assert sorted(before) == sorted(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name

    from transformers import LlamaForCausalLM
    assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load",
                                    str(tmp_path / "trained"), "--save",
                                    str(tmp_path / "exported")]) == 0
    exported = LlamaForCausalLM.from_pretrained(str(tmp_path / "exported"),
                                                attn_implementation="eager").eval()
    assert exported.config.vocab_size == 8000
    tokens = prompts(8000)
    with torch.no_grad(), one_thread():
        assert rel_err(exported(tokens).logits, hf_model(tokens).logits) < 1e-5


def test_tokenizer_files_travel_and_are_used(tmp_path):
    """The HF directory's tokenizer is copied and recorded (PretrainedFromHF): loading
    needs no tokenizer flags; the way back restores the files; a tokenizer larger than
    the vocabulary is refused."""
    from megatron.arguments import build_parser
    from megatron.training.checkpoint_setup import build_tokenizer_and_vocab, parse_inference_args
    from tests.hf_models import save_word_tokenizer
    hf_dir = tmp_path / "hf"
    model = save_hf_model("gpt2", str(hf_dir))
    save_word_tokenizer(str(hf_dir), 150)
    ckpt = converted(str(tmp_path), "gpt2")
    config, _, stored = parse_inference_args(build_parser(), ["--load", ckpt])
    tokenizer = build_tokenizer_and_vocab(config, stored)
    assert tokenizer.vocab_size == 150 and config.model.padded_vocab_size == 256
    assert tokenizer.tokenize("3 7 42") == [3, 7, 42]
    back = tmp_path / "back"
    assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load", ckpt,
                                    "--save", str(back)]) == 0
    for name in os.listdir(hf_dir):
        if name != "config.json":
            assert (back / name).read_bytes() == (hf_dir / name).read_bytes(), name

    too_big = tmp_path / "too_big"
    model.save_pretrained(str(too_big), safe_serialization=True)
    save_word_tokenizer(str(too_big), 300)
    code = convert_checkpoint.main(["--from", "hf", "--to", "megatron", "--load", str(too_big),
                                    "--save", str(tmp_path / "never")])
    assert code == 2 and not (tmp_path / "never").exists()


def test_sharded_safetensors_are_read(tmp_path):
    model = save_hf_model("llama", str(tmp_path / "sharded"))
    model.save_pretrained(str(tmp_path / "hf"), safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ckpt = converted(str(tmp_path), "llama")
    back = str(tmp_path / "back")
    assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load", ckpt,
                                    "--save", back]) == 0
    original = load_safetensors(str(tmp_path / "sharded" / "model.safetensors"))
    again = load_safetensors(os.path.join(back, "model.safetensors"))
    assert sorted(again) == sorted(original)
    assert all(torch.equal(again[k], t) for k, t in original.items())


def _without_hf_entry(ckpt: str, target) -> str:
    """A copy of a converted checkpoint as training would save it: no "hf" entry."""
    import shutil
    shutil.copytree(ckpt, target)
    path = os.path.join(target, "release", "mp_rank_00", "model_optim_rng.pt")
    state = safe_load(path)
    del state["config"]["hf"]
    save_file(state, path)  # with its checksum sidecar, as a save would
    return str(target)


def test_checkpoint_without_hf_entry_exports_an_equivalent_model(family, tmp_path):
    """The HF config derived from our config (Mistral's as LlamaForCausalLM) gives
    transformers' model the original's logits."""
    name, hf_model, work = family
    ckpt = _without_hf_entry(os.path.join(work, "ckpt_tp1_pp1"), tmp_path / "ckpt")
    vocab = hf_model.config.vocab_size
    back = str(tmp_path / "back")
    assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load", ckpt,
                                    "--save", back, "--hf-vocab-size", str(vocab)]) == 0
    from transformers import AutoModelForCausalLM
    exported = AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager").eval()
    tokens = prompts(vocab)
    with torch.no_grad(), one_thread():
        assert rel_err(exported(tokens).logits, hf_model(tokens).logits) < 1e-5


@pytest.mark.parametrize("field, value, message", [
    ("normalization", "RMSNorm", "normalization=RMSNorm cannot be expressed in GPT2LMHeadModel"),
    ("position_embedding_type", "none", "no Hugging Face architecture"),
])
def test_export_refuses_what_no_architecture_expresses(small_dirs, tmp_path, capsys, field,
                                                       value, message):
    import shutil
    shutil.copytree(small_dirs / "gpt2", tmp_path / "hf")
    ckpt = _without_hf_entry(converted(str(tmp_path), "gpt2"), tmp_path / "ckpt")
    path = os.path.join(ckpt, "release", "mp_rank_00", "model_optim_rng.pt")
    state = safe_load(path)
    state["config"]["model"][field] = value
    save_file(state, path)  # with its checksum sidecar, as a save would
    code = convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load", ckpt,
                                    "--save", str(tmp_path / "hf"), "--hf-vocab-size", "211"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("overrides", [
    {"tie_word_embeddings": True},
    {"attention_bias": True, "mlp_bias": True},
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
], ids=["tied", "biases", "linear-rope"])
def test_llama_variants(tmp_path, overrides):
    """Tied embeddings, biases (--add-qkv-bias with bias linears) and linear RoPE scaling
    (--rotary-seq-len-interpolation-factor): logits equal and the round trip is exact."""
    model = save_hf_model("llama", str(tmp_path / "hf"), **overrides)
    assert all(getattr(model.config, k) == v for k, v in overrides.items())
    ckpt = converted(str(tmp_path), "llama")
    vocab = model.config.vocab_size
    tokens = prompts(vocab)
    with one_thread():
        models, _, _, _ = load_ours(ckpt, vocab)
        with torch.no_grad():
            err = rel_err(models[0](tokens, position_ids(tokens))[..., :vocab],
                          model(tokens).logits)
    assert err < 1e-5
    back = str(tmp_path / "back")
    assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load", ckpt,
                                    "--save", back]) == 0
    original = load_safetensors(str(tmp_path / "hf" / "model.safetensors"))
    again = load_safetensors(os.path.join(back, "model.safetensors"))
    assert sorted(again) == sorted(original)
    assert all(torch.equal(again[k], t) for k, t in original.items())
