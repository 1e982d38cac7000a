"""A tiny Llama-4-style model trains like one process at every layout and resumes exactly.

Llama 4's layer: interleaved RoPE with llama3 scaling, q / k L2 norm after RoPE, attention
chunks of 8 over the 32 positions on RoPE layers 1-3, layer 4 NoPE (full causal) with
attention temperature tuning (floor scale 4, so it acts within 32 positions); layers 2 and
4 MoE (4 experts, top-1 sigmoid routing applied to the expert input, a shared expert, an
aux loss of 1e-2), 1 and 3 dense SwiGLU; untied head, GQA. Every layout runs micro batches
of 2, as the reference: the load-balancing loss is per micro batch, so another micro batch
size trains a different loss (TP 2 with micro batches of 4 differed by 2e-5). With the machinery of
tests/distributed/layouts.py: 10 iterations at TP 2 + sequence parallelism, PP 2 (saved at
iteration 5 and resumed), CP 2 (a2a; p2p refuses chunks in one line), EP 2 (alltoall) and
DP 2 with the distributed optimizer reproduce the single-process losses and gradient norms
within 1e-5. One spawn of 2 ranks.
"""
from dataclasses import replace

import pytest

from tests.distributed.layouts import (Layout, check_losses, check_resume, model_fixtures,
                                       train_layouts)

LLAMA4 = ["--position-embedding-type", "rope", "--rotary-interleaved", "--rotary-base", "500000",
          "--rope-scaling-type", "llama3", "--rope-scaling-factor", "8",
          "--rope-scaling-original-max-position-embeddings", "16", "--normalization", "RMSNorm",
          "--swiglu", "--disable-bias-linear", "--group-query-attention", "--num-query-groups",
          "2", "--untie-embeddings-and-output-weights", "--qk-l2-norm", "--no-rope-freq", "4",
          "--attention-chunk-size", "8", "--attn-temperature-tuning",
          "--attn-temperature-floor-scale", "4", "--ffn-hidden-size", "96", "--num-experts", "4",
          "--moe-router-topk", "1", "--moe-router-score-function", "sigmoid",
          "--moe-apply-probs-on-input", "--moe-ffn-hidden-size", "32",
          "--moe-shared-expert-intermediate-size", "32", "--moe-layer-freq", "([0]*1+[1]*1)*2",
          "--moe-aux-loss-coeff", "1e-2"]
LAYOUTS = {
    "tp2-sequence-parallel": Layout(2, 1, 1, mbs=2, extra=LLAMA4 + ["--sequence-parallel"]),
    "pp2": replace(Layout(1, 2, 1, mbs=2, extra=LLAMA4), resume=True),
    "cp2-a2a": Layout(1, 1, 1, mbs=2, cp=2, extra=LLAMA4 + ["--cp-comm-type", "a2a"]),
    "ep2-alltoall": Layout(1, 1, 2, mbs=2, extra=LLAMA4 + [
        "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]),
    "dp2-distributed-optimizer": Layout(1, 1, 2, mbs=2,
                                        extra=LLAMA4 + ["--use-distributed-optimizer"]),
}


def _rank(rank, world_size, data_prefix, workdir):
    return train_layouts(LAYOUTS, world_size, data_prefix, workdir)


workdir, reference, spawns = model_fixtures("llama4-layouts", LAYOUTS, LLAMA4, _rank)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_llama4_layout_losses_equal_one_process(name, reference, spawns):
    check_losses(name, LAYOUTS[name], spawns[2], reference)


def test_llama4_pp2_resumes_exactly(workdir, spawns):
    check_resume("pp2", LAYOUTS["pp2"], spawns[2], workdir[1])


def test_cp2_p2p_refuses_chunks_in_one_line(capsys, tmp_path):
    from megatron.arguments import parse_args
    from tests.gpt_setup import tiny_gpt_argv
    argv = tiny_gpt_argv(tmp_path / "data", tmp_path, "--context-parallel-size", "2",
                         "--cp-comm-type", "p2p", *LLAMA4)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, world_size=2)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--attention-chunk-size 8 with --cp-comm-type p2p is not supported" in err
