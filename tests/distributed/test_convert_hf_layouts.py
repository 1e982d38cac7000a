"""Converted Hugging Face models at TP = 2 x PP = 2 (and TP = 2 for generation) compute
what `transformers` computes.

The parent saves one small random model per family, converts it to TP 2 x PP 2 and
to TP 2 x PP 1, and computes transformers' logits and greedy tokens; one spawn of
4 gloo ranks loads every conversion through the entry points' loading path: the
PP 2 one runs a forward over both stages (stage 0 sends its activations to stage 1),
the PP 1 one (TP 2 x DP 2) generates greedily with the KV cache. Converting the
TP 2 x PP 2 checkpoint back to HF gives the original tensors.
"""
import os

import torch

from megatron.text_generation import generate
from tests import oracles
from tests.distributed.run_ranks import run_ranks
from tests.hf_models import (converted, FAMILIES, hf_greedy, load_ours, load_safetensors,
                             NEW_TOKENS, pipeline_logits, PROMPT_LEN, prompts, rel_err,
                             save_hf_model)
from tools import convert_checkpoint

pytestmark = oracles.needs("transformers")


def _worker(rank, world_size, cases):
    logits, greedy, pstate = {}, {}, None
    for name, work, vocab, tokens in cases:
        logits[name], pstate = pipeline_logits(os.path.join(work, "ckpt_tp2_pp2"), vocab,
                                               tokens, pstate, tp=2)
    pstate = None
    for name, work, vocab, tokens in cases:
        models, tokenizer, pstate, _ = load_ours(os.path.join(work, "ckpt_tp2_pp1"), vocab,
                                                 tp=2, pstate=pstate)
        greedy[name] = generate(models[0], tokenizer, tokens[:, :PROMPT_LEN].tolist(),
                                NEW_TOKENS, greedy=True, eod_stop=False)
    return {name: (logits[name], greedy[name]) for name in logits}


def _check_way_back(work: str, ckpt: str) -> None:
    """Merging the TP 2 x PP 2 checkpoint back to HF gives the original tensors."""
    back = os.path.join(work, "back")
    assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load",
                                    os.path.join(work, ckpt), "--save", back]) == 0
    original = load_safetensors(os.path.join(work, "hf", "model.safetensors"))
    again = load_safetensors(os.path.join(back, "model.safetensors"))
    assert sorted(again) == sorted(original)
    assert all(torch.equal(again[k], t) for k, t in original.items())


def test_converted_models_match_transformers_at_tp2_pp2(tmp_path):
    cases, expected = [], {}
    for name in sorted(FAMILIES):
        work = str(tmp_path / name)
        model = save_hf_model(name, os.path.join(work, "hf"))
        for tp, pp in ((2, 2), (2, 1)):
            converted(work, name, tp, pp)
        _check_way_back(work, "ckpt_tp2_pp2")
        vocab = model.config.vocab_size
        tokens = prompts(vocab)
        with torch.no_grad():
            expected[name] = (model(tokens).logits, hf_greedy(model, tokens[:, :PROMPT_LEN]))
        cases.append((name, work, vocab, tokens))
    results = run_ranks(_worker, 4, cases, timeout=300)
    for rank, result in enumerate(results):
        for name, (logits, greedy) in result.items():
            assert greedy == expected[name][1], (rank, name)
            if rank >= 2:  # the last pipeline stage
                assert rel_err(logits, expected[name][0]) < 1e-5, (rank, name)
            else:
                assert logits is None
