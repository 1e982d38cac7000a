"""A converted model of each MoE family of issue 31 at TP 2 x EP 2 (expert TP 2) and at
PP 2 x EP 2 computes transformers' logits within 1e-5 at 64 positions, and comes back
tensor-identical: gpt-oss (tests/unit/test_convert_hf_gpt_oss.py's: sliding and full layers,
sinks, biased router and experts) and Llama 4 (tests/unit/test_convert_hf_llama4.py's:
chunked RoPE layers, a NoPE layer with temperature tuning, q / k L2 norm, dense and MoE
layers with top-1 sigmoid routing on the expert input and a shared expert).

The parent converts to TP 2 and to PP 2 and re-shards each to EP 2
(tools/merge_mp_partitions.py --target-expert-model-parallel-size 2); a spawn of 4 gloo
ranks per layout loads it through the entry points' loading path with
--expert-model-parallel-size 2 and runs one forward. Converting each back to HF gives the
original tensors."""
import os

import pytest
import torch

from tests import oracles
from tests.distributed.run_ranks import run_ranks
from tests.hf_models import (converted, load_ours, load_safetensors, pipeline_logits,
                             position_ids, rel_err, save_hf_model)
from tools import convert_checkpoint, merge_mp_partitions

pytestmark = oracles.needs("transformers")

EP2 = ("--expert-model-parallel-size", "2")


def _tp2_ep2(rank, world_size, ckpt, vocab, tokens):
    models, _, _, _ = load_ours(ckpt, vocab, tp=2, extra=EP2)
    with torch.no_grad():
        return models[0](tokens, position_ids(tokens))[..., :vocab].numpy()


def _pp2_ep2(rank, world_size, ckpt, vocab, tokens):
    logits, _ = pipeline_logits(ckpt, vocab, tokens, None, extra=EP2)
    return None if logits is None else logits.numpy()


def _ep2(work, family, tp, pp):
    source = converted(work, family, tp, pp)
    target = os.path.join(work, f"ckpt_tp{tp}_pp{pp}_ep2")
    assert merge_mp_partitions.main([
        "--load", source, "--save", target, "--target-tensor-model-parallel-size", str(tp),
        "--target-pipeline-model-parallel-size", str(pp),
        "--target-expert-model-parallel-size", "2"]) == 0
    back = os.path.join(work, f"back_tp{tp}_pp{pp}")
    assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load", target,
                                    "--save", back]) == 0
    original = load_safetensors(os.path.join(work, "hf", "model.safetensors"))
    again = load_safetensors(os.path.join(back, "model.safetensors"))
    assert sorted(again) == sorted(original)
    assert all(torch.equal(again[k], t) for k, t in original.items()), (tp, pp)
    return target


@pytest.mark.parametrize("family", ["gpt_oss", "llama4"])
def test_at_tp2_ep2_and_pp2_ep2_equals_transformers(tmp_path, family):
    work = str(tmp_path)
    model = save_hf_model(family, os.path.join(work, "hf"))
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(tokens).logits
    for rank, logits in enumerate(run_ranks(_tp2_ep2, 4, _ep2(work, family, 2, 1), vocab, tokens)):
        assert rel_err(torch.from_numpy(logits), expected) < 1e-5, ("tp2 x ep2", rank)
    results = run_ranks(_pp2_ep2, 4, _ep2(work, family, 1, 2), vocab, tokens)
    for rank, logits in enumerate(results):
        if rank >= 2:  # the last pipeline stage (both of its EP ranks)
            assert rel_err(torch.from_numpy(logits), expected) < 1e-5, ("pp2 x ep2", rank)
        else:
            assert logits is None
