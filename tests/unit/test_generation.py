"""Sampling filters, KV-cache decoding against full recomputation, and the sampling tool."""
import json

import pytest
import torch

from megatron.config import CheckpointConfig, Config, DataConfig, ModelConfig
from megatron.model import GPTModel
from megatron.mpu import model_parallel_seed, single_process_state
from megatron.text_generation import (GenerationError, KVCache, SamplingParams, apply_temperature,
                                      forward_full, forward_with_cache, generate,
                                      mask_padded_vocab, sample, top_k_filter, top_p_filter)
from megatron.tokenizer import ByteLevelTokenizer
from megatron.checkpointing import api
from megatron.checkpointing.formats import RunState
from tools import generate_samples_gpt

INF = float("-inf")


def tiny_config(**overrides) -> ModelConfig:
    values = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32,
                  max_position_embeddings=64, padded_vocab_size=384, hidden_dropout=0.0,
                  attention_dropout=0.0, layer_norm_fusion=False, masked_softmax_fusion=False)
    values.update(overrides)
    return ModelConfig(**values)


def tiny_model(seed=3, **overrides) -> GPTModel:
    model_parallel_seed(1234, 0)
    model = GPTModel(tiny_config(**overrides))
    model.init_weights(seed)
    return model.eval()


# -- sampling ------------------------------------------------------------------------
def test_top_k_keeps_the_k_largest_and_ties():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [0.0, 2.0, 2.0, 1.0, -1.0]])
    out = top_k_filter(logits, 2)
    assert torch.equal(torch.isfinite(out[0]), torch.tensor([False, True, False, True, False]))
    assert torch.equal(torch.isfinite(out[1]), torch.tensor([False, True, True, False, False]))
    assert torch.equal(top_k_filter(logits, 0), logits)
    assert torch.equal(top_k_filter(logits, 9), logits)


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = lambda p: torch.isfinite(top_p_filter(logits, p))[0].tolist()  # noqa: E731
    assert kept(0.5) == [True, False, False, False]
    assert kept(0.6) == [True, True, False, False]
    assert kept(0.8) == [True, True, False, False]
    assert kept(0.81) == [True, True, True, False]
    assert kept(0.01) == [True, False, False, False]
    # rows are independent and order of the vocabulary does not matter
    shuffled = logits[:, [2, 0, 3, 1]]
    assert torch.isfinite(top_p_filter(shuffled, 0.6))[0].tolist() == [False, True, False, True]


def test_temperature_and_padded_vocab():
    logits = torch.tensor([[2.0, 4.0, 8.0]])
    assert torch.allclose(apply_temperature(logits, 2.0), torch.tensor([[1.0, 2.0, 4.0]]))
    masked = mask_padded_vocab(logits, 2)
    assert masked[0, 2] == INF and torch.equal(masked[0, :2], logits[0, :2])
    assert torch.equal(logits, torch.tensor([[2.0, 4.0, 8.0]]))  # input untouched
    assert sample(logits, SamplingParams(greedy=True)).tolist() == [2]
    assert sample(logits, SamplingParams(greedy=True), vocab_size=2).tolist() == [1]


def test_sample_respects_filters_and_seed():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = SamplingParams(top_k=3, temperature=0.7)
    allowed = torch.topk(logits, 3).indices
    gen = torch.Generator().manual_seed(5)
    draws = torch.stack([sample(logits, params, generator=gen) for _ in range(200)])
    assert all(bool((allowed[row] == draws[:, row:row + 1]).any(-1).all()) for row in range(4))
    assert len(set(draws[:, 0].tolist())) > 1  # it does sample
    again = torch.stack([sample(logits, params, generator=torch.Generator().manual_seed(5))
                         for _ in range(1)])
    assert torch.equal(again[0], draws[0])
    nucleus = sample(logits, SamplingParams(top_p=1e-6), generator=gen)
    assert torch.equal(nucleus, logits.argmax(-1))


@pytest.mark.parametrize("kwargs, word", [
    (dict(top_k=-1), "top_k"), (dict(top_p=1.5), "top_p"), (dict(temperature=0.0), "temperature"),
    (dict(top_k=5, top_p=0.9), "cannot both"), (dict(greedy=True, top_k=4), "greedy")])
def test_sampling_params_errors(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


# -- KV cache ------------------------------------------------------------------------
def test_cached_forward_matches_full_forward():
    model = tiny_model()
    tokens = torch.randint(0, 257, (3, 20), generator=torch.Generator().manual_seed(1))
    full = forward_full(model, tokens)
    cache = KVCache.for_model(model, 3, 20)
    parts = [forward_with_cache(model, tokens[:, a:b], cache, last_only=False)
             for a, b in ((0, 7), (7, 8), (8, 9), (9, 20))]
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(GenerationError, match="KV cache holds 20"):
        forward_with_cache(model, tokens[:, :1], cache)


def test_kv_cache_greedy_equals_recomputation():
    model = tiny_model()
    tok = ByteLevelTokenizer()
    prompts = ["Hello", "a much longer prompt", "", [5, 6, 7]]
    cached = generate(model, tok, prompts, 24, greedy=True, eod_stop=False)
    full = generate(model, tok, prompts, 24, greedy=True, eod_stop=False, use_cache=False)
    assert cached == full
    assert [len(ids) for ids in cached] == [24] * 4
    # batching does not change a row's continuation
    assert generate(model, tok, ["Hello"], 24, greedy=True, eod_stop=False)[0] == cached[0]
    assert model.training is False


def test_seeded_sampling_is_reproducible_with_and_without_cache():
    model = tiny_model()
    tok = ByteLevelTokenizer()
    a = generate(model, tok, ["abc", "xy"], 12, top_k=5, seed=11, eod_stop=False)
    b = generate(model, tok, ["abc", "xy"], 12, top_k=5, seed=11, eod_stop=False)
    c = generate(model, tok, ["abc", "xy"], 12, top_k=5, seed=11, eod_stop=False, use_cache=False)
    assert a == b == c


def test_eod_stop_and_limits():
    model = tiny_model()
    tok = ByteLevelTokenizer()
    free = generate(model, tok, ["q", "zz"], 30, greedy=True, eod_stop=False)
    # a copy whose eod logit is 3x the best one at the first step of row 0
    eod_model = tiny_model()
    emb = eod_model.language_model.embedding.word_embeddings.weight
    with torch.no_grad():
        emb[tok.eod] = 3.0 * emb[free[0][0]]
    forced = generate(eod_model, tok, ["q", "zz"], 30, greedy=True, eod_stop=False)
    assert forced[0][0] == tok.eod
    stopped = generate(eod_model, tok, ["q", "zz"], 30, greedy=True)
    assert stopped[0] == []
    row1 = forced[1].index(tok.eod) if tok.eod in forced[1] else 30
    assert stopped[1] == forced[1][:row1]  # the other row goes on until its own eod
    assert generate(model, tok, ["q", "rr"], 0) == [[], []]
    with pytest.raises(GenerationError, match="max-position-embeddings 64"):
        generate(model, tok, ["x" * 60], 10, greedy=True)
    with pytest.raises(GenerationError, match="outside the model's vocabulary"):
        generate(model, tok, [[1000]], 2, greedy=True)


def test_pipeline_stage_and_sequence_parallel_are_refused():
    model_parallel_seed(1234, 0)
    stage = GPTModel(tiny_config(), post_process=False)
    with pytest.raises(GenerationError, match="merge_mp_partitions"):
        generate(stage, ByteLevelTokenizer(), ["a"], 2)
    sp = GPTModel(tiny_config(sequence_parallel=True))
    with pytest.raises(GenerationError, match="sequence parallelism"):
        generate(sp, ByteLevelTokenizer(), ["a"], 2)


# -- tools/generate_samples_gpt.py ------------------------------------------------------
@pytest.fixture
def checkpoint(tmp_path):
    """A random tiny model saved with its config (ByteLevelTokenizer: needs no files)."""
    model = tiny_model(seed=7)
    config = Config(model=tiny_config(), data=DataConfig(tokenizer_type="ByteLevelTokenizer"),
                    checkpoint=CheckpointConfig(no_save_optim=True, no_save_rng=True))
    root = tmp_path / "ckpt"
    api.save(str(root), 7, RunState([model], config, single_process_state()))
    return root, model


def test_tool_uses_stored_config_and_matches_generate(checkpoint, tmp_path, capsys):
    root, model = checkpoint
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon\n\nthe end\n")
    out = tmp_path / "out" / "samples.txt"
    records = generate_samples_gpt.main([
        "--load", str(root), "--sample-input-file", str(prompts), "--prompt", "x",
        "--out-seq-length", "10", "--greedy", "--micro-batch-size", "2",
        "--sample-output-file", str(out)])
    expected = generate(model, ByteLevelTokenizer(), ["x", "Once upon", "the end"], 10, greedy=True)
    assert [r["tokens"] for r in records] == expected
    text = out.read_text()
    assert text.count("\nContext: ") == 3 and "Megatron-LM: " in text
    assert "Context: Once upon" in capsys.readouterr().out


def test_tool_unconditional_jsonl(checkpoint, tmp_path):
    root, _ = checkpoint
    out = tmp_path / "uncond.jsonl"
    generate_samples_gpt.main(["--load", str(root), "--num-samples", "3", "--out-seq-length", "5",
                               "--top_p", "0.9", "--sample-output-file", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 3 and all(set(r) == {"text", "length", "finished"} for r in lines)
    assert all(r["length"] <= 5 for r in lines)


def test_tool_says_once_that_out_seq_length_exceeds_the_position_limit(checkpoint, capsys):
    """64 positions: --out-seq-length 100 cannot be met after any prompt; one notice says so
    (not one per batch), and each sample still fills the positions its prompt leaves."""
    root, _ = checkpoint
    records = generate_samples_gpt.main(["--load", str(root), "--prompt", "x", "--prompt",
                                         "Once upon", "--out-seq-length", "100", "--greedy"])
    assert [len(r["tokens"]) for r in records] == [63, 55]
    err = capsys.readouterr().err
    assert err.count("exceeds the position limit") == 1, err
    assert " > --out-seq-length 100 exceeds the position limit" in err
    assert "--max-position-embeddings (64)" in err and "(63 here)" in err
    generate_samples_gpt.main(["--load", str(root), "--prompt", "x", "--out-seq-length", "63"])
    assert "position limit" not in capsys.readouterr().err


@pytest.mark.parametrize("extra, code, message", [
    (["--prompt", "a", "--top_k", "3", "--top_p", "0.5"], 2, "cannot both"),
    ([], 2, "nothing to generate"),
    (["--prompt", "a", "--pipeline-model-parallel-size", "2"], 2,
     "drop --pipeline-model-parallel-size"),
    (["--prompt", "a", "--hidden-size", "64"], 2, "--hidden-size 64 does not match the checkpoint"),
])
def test_tool_errors(checkpoint, capsys, monkeypatch, extra, code, message):
    root, _ = checkpoint
    if "--pipeline-model-parallel-size" in extra:
        monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun: the layout itself is valid
    with pytest.raises(SystemExit) as exit_info:
        generate_samples_gpt.main(["--load", str(root)] + extra)
    assert exit_info.value.code == code
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_tool_needs_a_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        generate_samples_gpt.main(["--prompt", "a"])
    assert exit_info.value.code == 2 and "--load is required" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        generate_samples_gpt.main(["--load", str(tmp_path), "--prompt", "a"])
    assert exit_info.value.code == 2 and "no checkpoint" in capsys.readouterr().err
