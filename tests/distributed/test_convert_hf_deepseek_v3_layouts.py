"""A converted DeepseekV3ForCausalLM (tests/unit/test_convert_hf_deepseek_v3.py's: MLA with
q_lora_rank, a first dense layer, grouped sigmoid top-4 with an expert bias, 2 shared
experts, YaRN, DeepSeek's MTP layer in the file; here 4 layers) at TP 2 x EP 2 x PP 2
computes transformers' logits within 1e-5, and comes back tensor-identical.

The parent converts to TP 2 x PP 2 and re-shards to EP 2 (tools/merge_mp_partitions.py
--target-expert-model-parallel-size 2); one spawn of 8 gloo ranks loads it through the
entry points' loading path with --expert-model-parallel-size 2 and runs one forward
(the MTP layer on the last stage, skipped by logits)."""
import os

import torch

from tests import oracles
from tests.distributed.run_ranks import run_ranks
from tests.hf_models import converted, load_safetensors, pipeline_logits, prompts, rel_err
from tests.unit.test_convert_hf_deepseek_v3 import save_with_mtp
from tools import convert_checkpoint, merge_mp_partitions

pytestmark = oracles.needs("transformers")


def _tp2_ep2_pp2(rank, world_size, ckpt, vocab, tokens):
    logits, _ = pipeline_logits(ckpt, vocab, tokens, None, tp=2,
                                extra=("--expert-model-parallel-size", "2"))
    return None if logits is None else logits.numpy()


def test_deepseek_v3_at_tp2_ep2_pp2_equals_transformers(tmp_path):
    work = str(tmp_path)
    model = save_with_mtp("deepseek_v3", os.path.join(work, "hf"), num_hidden_layers=4)
    vocab = model.config.vocab_size
    source = converted(work, "deepseek_v3", 2, 2)
    target = os.path.join(work, "ckpt_tp2_pp2_ep2")
    assert merge_mp_partitions.main([
        "--load", source, "--save", target, "--target-tensor-model-parallel-size", "2",
        "--target-pipeline-model-parallel-size", "2",
        "--target-expert-model-parallel-size", "2"]) == 0
    back = os.path.join(work, "back")
    assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load", target,
                                    "--save", back]) == 0
    original = load_safetensors(os.path.join(work, "hf", "model.safetensors"))
    again = load_safetensors(os.path.join(back, "model.safetensors"))
    assert sorted(again) == sorted(original)
    assert all(torch.equal(again[k], t) for k, t in original.items())
    tokens = prompts(vocab)
    with torch.no_grad():
        expected = model(tokens).logits
    for rank, logits in enumerate(run_ranks(_tp2_ep2_pp2, 8, target, vocab, tokens)):
        if rank >= 4:  # the last pipeline stage (its TP x EP ranks)
            assert rel_err(torch.from_numpy(logits), expected) < 1e-5, rank
        else:
            assert logits is None, rank
