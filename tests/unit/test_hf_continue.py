"""Continue from a Hugging Face model as users do: convert, train with
`pretrain_gpt.py --load <converted>` and only data / batch / schedule / --save flags,
export; checked against `transformers` itself.

The first iteration's loss is transformers' loss on the very batch the run trained on
(the padding rows of the vocabulary never count); the exported model's logits are those
of the continued checkpoint; the exported architecture, its generation config and
tokenizer files are the original's, also after the checkpoint is moved.
"""
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

import pretrain_gpt
from tests import oracles
from tests.gpt_setup import losses, one_thread
from tests.hf_models import (FAMILIES, converted, position_ids, prompts,
                             rel_err, save_hf_model, save_word_tokenizer)
from megatron.checkpointing.megatron_legacy import safe_load
from tools import convert_checkpoint

pytestmark = oracles.needs("transformers")

NO_DROPOUT = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)}
SEQ = 32
GREEDY = ["--prompt", "3 7 42 5", "--prompt", "11 12", "--out-seq-length", "12", "--greedy"]


def run_flags(save, iters: int = 5):
    """Data, batch, schedule and --save: nothing about the model."""
    return ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--seq-length", str(SEQ), "--train-iters", str(iters), "--lr", "1e-4",
            "--lr-warmup-iters", "1", "--eval-iters", "0", "--log-interval", "1",
            "--num-workers", "0", "--save", str(save), "--save-interval", str(iters)]


def prepare(tmp_path, family: str, **overrides):
    """(HF model, converted checkpoint) of a random `family` model with a word tokenizer of
    fewer ids than the model's vocabulary rows (as Qwen2.5's) and a generation config
    carrying bos / eos ids."""
    hf_dir = str(tmp_path / "hf")
    model = save_hf_model(family, hf_dir, **NO_DROPOUT.get(family, {}), **overrides)
    save_word_tokenizer(hf_dir, model.config.vocab_size - 1)
    with open(os.path.join(hf_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 2, "eos_token_id": 1}, f)
    return model, converted(str(tmp_path), family)


def record_batches(monkeypatch):
    """The (tokens, labels) of every micro batch pretrain_gpt trains on."""
    seen = []
    real = pretrain_gpt.gpt_batch

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append((out[0].clone(), out[1].clone()))
        return out
    monkeypatch.setattr(pretrain_gpt, "gpt_batch", recording)
    return seen


def load_with_own_tokenizer(ckpt: str):
    """Our model of `ckpt` through the inference loading path, flags all from the checkpoint."""
    from megatron.arguments import build_parser
    from megatron.training.checkpoint_setup import (build_tokenizer_and_vocab, load_inference_models,
                                                parse_inference_args)
    from megatron.training.initialize import initialize_distributed
    config, _, stored = parse_inference_args(build_parser(), ["--load", ckpt])
    build_tokenizer_and_vocab(config, stored)
    pstate, _ = initialize_distributed(config)
    models, _ = load_inference_models(config, pstate, torch.device("cpu"), parallel_output=False)
    return models[0]


def hf_loss(model, tokens, labels) -> float:
    with torch.no_grad():
        logits = model(tokens).logits.float()
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)))


@pytest.mark.parametrize("family", sorted(FAMILIES) + ["gpt_oss", "llama4"])
def test_continue_from_converted_model(family, tmp_path, monkeypatch):
    model, ckpt = prepare(tmp_path, family)
    batches = record_batches(monkeypatch)
    trained = tmp_path / "trained"
    with one_thread():
        state = pretrain_gpt.main(["--load", ckpt, *run_flags(trained)])
    first = losses(state)[0]
    expected = hf_loss(model, *batches[0])
    assert abs(first - expected) / expected < 1e-5, (first, expected)

    exported = tmp_path / "exported"
    assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load", str(trained),
                                    "--save", str(exported)]) == 0
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == model.config.architectures
    assert json.loads((exported / "generation_config.json").read_text())["eos_token_id"] == 1
    assert (exported / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json") \
        .read_bytes()
    from transformers import AutoModelForCausalLM
    back = AutoModelForCausalLM.from_pretrained(str(exported), attn_implementation="eager").eval()
    vocab = model.config.vocab_size
    tokens = prompts(vocab)
    with torch.no_grad(), one_thread():
        ours = load_with_own_tokenizer(str(trained))
        theirs = back(tokens).logits
        assert rel_err(ours(tokens, position_ids(tokens))[..., :vocab], theirs) < 1e-5
        assert rel_err(theirs, model(tokens).logits) > 1e-4  # training changed the weights


@pytest.mark.parametrize("flags, shown", [
    (["--rotary-base", "10000"], "--rotary-base 10000"),
    (["--normalization", "LayerNorm"], "--normalization LayerNorm"),
    (["--norm-epsilon", "1e-6"], "--norm-epsilon 1e-06"),
    (["--num-query-groups", "4"], "--num-query-groups 4"),
])
def test_contradicting_flag_is_one_line_exit_2(flags, shown, tmp_path, capsys):
    _, ckpt = prepare(tmp_path, "llama")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main(["--load", ckpt, *run_flags(tmp_path / "never"), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert shown in err[0] and "saved with" in err[0]
    assert not (tmp_path / "never" / "latest_checkpointed_iteration.txt").exists()


def test_padding_rows_count_only_with_the_megatron_flag(tmp_path, monkeypatch):
    """--no-mask-vocab-padding restores Megatron-LM's loss over the padded rows (zero rows:
    log(V_padded) is in the normaliser), which is larger than transformers'."""
    model, ckpt = prepare(tmp_path, "llama")
    batches = record_batches(monkeypatch)
    with one_thread():
        state = pretrain_gpt.main(["--load", ckpt, *run_flags(tmp_path / "t", iters=1),
                                   "--no-mask-vocab-padding"])
    assert losses(state)[0] > hf_loss(model, *batches[0]) * (1 + 1e-4)


def test_loading_lines_and_moved_checkpoint(tmp_path, capsys):
    """A moved converted checkpoint still finds its tokenizer files (stored relatively),
    continues, and a continued Mistral exports as MistralForCausalLM with its bos / eos."""
    _, ckpt = prepare(tmp_path, "mistral")
    moved = str(tmp_path / "elsewhere" / "ckpt")
    shutil.move(ckpt, moved)
    shutil.rmtree(tmp_path / "hf")
    from tools import generate_samples_gpt
    with one_thread():
        records = generate_samples_gpt.main(["--load", moved, *GREEDY])
        assert len(records) == 2 and all(r["tokens"] for r in records)
        assert records[0]["text"].split()[0].isdigit()  # the word tokenizer read from the move
        capsys.readouterr()
        pretrain_gpt.main(["--load", moved, *run_flags(tmp_path / "t", iters=1)])
    out = capsys.readouterr().out
    assert f" loading checkpoint from {moved} at iteration 0 (format release, saved at TP 1 x " \
           f"PP 1)" in out
    assert f"  successfully loaded checkpoint from {moved} at iteration 0" in out
    stored = safe_load(str(tmp_path / "t" / "iter_0000001" / "mp_rank_00" /
                           "model_optim_rng.pt"))["config"]
    assert stored["data"]["tokenizer_name_or_path"] == "hf_files"
    assert stored["hf"]["architecture"] == "MistralForCausalLM"
    shutil.move(str(tmp_path / "t"), str(tmp_path / "t2"))
    exported = tmp_path / "exported"
    assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load",
                                    str(tmp_path / "t2"), "--save", str(exported)]) == 0
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["MistralForCausalLM"]
    generation = json.loads((exported / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (2, 1)
    assert (exported / "tokenizer.json").is_file()


def test_inference_layout_follows_the_checkpoint():
    from megatron.training.checkpoint_setup import inference_layout
    assert inference_layout((2, 2), 4, None, None, False) == (2, 2)  # torchrun, no flags
    assert inference_layout((2, 2), 4, None, None, True) == (2, 1)  # one stage, DP 2
    assert inference_layout((2, 2), 1, None, None, False) == (1, 1)  # one process
    assert inference_layout((4, 1), 2, None, None, False) == (2, 1)
    assert inference_layout((2, 2), 4, 4, None, True) == (4, 1)  # the flag given wins
    assert inference_layout((1, 1), 8, None, None, False) == (1, 1)  # DP 8


def test_generation_from_a_pipeline_checkpoint_in_one_process(tmp_path, capsys):
    """A TP 2 x PP 2 conversion, sampled in one process without layout flags (and with
    training's --train-samples), is re-sharded in memory and gives the TP 1 tokens."""
    from tools import generate_samples_gpt
    prepare(tmp_path, "llama")
    pipeline = converted(str(tmp_path), "llama", 2, 2)
    with one_thread():
        reference = generate_samples_gpt.main(["--load", str(tmp_path / "ckpt_tp1_pp1"), *GREEDY])
        capsys.readouterr()
        records = generate_samples_gpt.main(["--load", pipeline, "--train-samples", "100",
                                             "--micro-batch-size", "4", *GREEDY])
    captured = capsys.readouterr()
    assert "re-sharding" in captured.out
    assert " generated 2/2 samples | " in captured.err and "tokens/s" in captured.err
    assert [r["tokens"] for r in records] == [r["tokens"] for r in reference]
    assert all(len(r["tokens"]) == 12 for r in reference)


def test_run_time_switches_are_not_taken_from_the_checkpoint():
    """A resumed run takes recomputation, fusions and kernels from its own flags: a stored
    --checkpoint-activations (store_true) could never be turned off again, a stored
    --no-bias-gelu-fusion never on. Architecture fields (RoPE scaling ones too) are taken."""
    from megatron.arguments import build_parser
    from megatron.training.checkpoint_setup import checkpoint_defaults
    stored = {"model": {"checkpoint_activations": True, "bias_gelu_fusion": False,
                        "sequence_parallel": True, "hidden_size": 64, "window_size": 16,
                        "rope_scaling_type": "llama3", "rope_scaling_factor": 32.0}}
    defaults = checkpoint_defaults(build_parser("test"), stored)
    for name in ("checkpoint_activations", "bias_gelu_fusion", "sequence_parallel"):
        assert f"model.{name}" not in defaults, name
    assert {k: defaults[f"model.{k}"] for k in ("hidden_size", "window_size", "rope_scaling_type",
                                                "rope_scaling_factor")} == {
        "hidden_size": 64, "window_size": 16, "rope_scaling_type": "llama3",
        "rope_scaling_factor": 32.0}


def test_a_resharded_converted_checkpoint_keeps_its_tokenizer_files(tmp_path):
    """tools/merge_mp_partitions.py carries hf_files into the re-sharded checkpoint (the
    README's convert-then-reshard flow), whose stored relative names then resolve there."""
    from tools import merge_mp_partitions
    _, ckpt = prepare(tmp_path, "mistral")
    resharded = tmp_path / "tp2"
    assert merge_mp_partitions.main(["--load", ckpt, "--save", str(resharded),
                                     "--target-tensor-model-parallel-size", "2"]) == 0
    shutil.rmtree(tmp_path / "hf")
    assert sorted(os.listdir(resharded / "hf_files")) == sorted(
        os.listdir(os.path.join(ckpt, "hf_files")))
    shutil.rmtree(ckpt)
    from tools import generate_samples_gpt
    with one_thread():
        records = generate_samples_gpt.main(["--load", str(resharded), *GREEDY])
    assert records[0]["text"].split()[0].isdigit()  # the word tokenizer, read from tp2/hf_files
