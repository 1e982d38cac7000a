"""Converted Mixtral, Qwen2-MoE and Qwen3-MoE models at EP 2 x PP 2 compute what
`transformers` computes, and come back tensor-identical.

The parent converts each small random model to PP 2 and re-shards that to EP 2 x PP 2
(tools/merge_mp_partitions.py --target-expert-model-parallel-size 2); one spawn of 4
gloo ranks loads every conversion through the entry points' loading path with
--expert-model-parallel-size 2 and runs a forward over both stages (the two EP ranks
of each stage exchange tokens); the last stage's logits equal transformers' within
1e-5. Converting the EP 2 x PP 2 checkpoint back to HF gives the original tensors.
"""
import os

import torch

from tests import oracles
from tests.distributed.run_ranks import run_ranks
from tests.hf_models import (converted, load_safetensors, MOE_FAMILIES, pipeline_logits,
                             prompts, rel_err, save_hf_model)
from tools import convert_checkpoint, merge_mp_partitions

pytestmark = oracles.needs("transformers")

EP2 = ("--expert-model-parallel-size", "2")


def _logits(ckpt, vocab, tokens, pstate):
    logits, pstate = pipeline_logits(ckpt, vocab, tokens, pstate, extra=EP2)
    return (None if logits is None else logits.numpy()), pstate


def _worker(rank, world_size, cases):
    out, pstate = {}, None
    for name, ckpt, vocab, tokens in cases:
        out[name], pstate = _logits(ckpt, vocab, tokens, pstate)
    return out


def test_converted_moe_models_match_transformers_at_ep2_pp2(tmp_path):
    cases, expected = [], {}
    for name in sorted(MOE_FAMILIES):
        work = str(tmp_path / name)
        model = save_hf_model(name, os.path.join(work, "hf"))
        pp2 = converted(work, name, 1, 2)
        ep2 = os.path.join(work, "ckpt_ep2_pp2")
        assert merge_mp_partitions.main(["--load", pp2, "--save", ep2,
                                         "--target-pipeline-model-parallel-size", "2",
                                         "--target-expert-model-parallel-size", "2"]) == 0
        back = os.path.join(work, "back")
        assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load", ep2,
                                        "--save", back]) == 0
        original = load_safetensors(os.path.join(work, "hf", "model.safetensors"))
        again = load_safetensors(os.path.join(back, "model.safetensors"))
        assert sorted(again) == sorted(original)
        assert all(torch.equal(again[k], t) for k, t in original.items()), name
        vocab = model.config.vocab_size
        tokens = prompts(vocab)
        with torch.no_grad():
            expected[name] = model(tokens).logits
        cases.append((name, ep2, vocab, tokens))
    results = run_ranks(_worker, 4, cases, timeout=600)
    for rank, result in enumerate(results):
        for name, logits in result.items():
            if rank >= 2:  # the last pipeline stage (both of its EP ranks)
                assert rel_err(torch.from_numpy(logits), expected[name]) < 1e-5, (rank, name)
            else:
                assert logits is None
