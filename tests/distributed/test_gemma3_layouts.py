"""A tiny Gemma-3-style model trains like one process at every layout and resumes exactly.

Gemma 3's layer (sandwich and (1 + w) q / k norms, a softmax scale apart from
1 / sqrt(d), tanh GeGLU, sqrt(h)-like embedding multiplier, tied embeddings) with its
attention kinds: layers 1-3 slide a window of 8 over the 32 positions with RoPE base 10k,
layer 4 attends to all with base 1M and linear scaling 8. With the machinery of
tests/distributed/layouts.py: 10 iterations at TP 2 + sequence parallelism, PP 2 (the
stages hold a sliding and a full layer each; saved at iteration 5 and resumed), CP 2
(a2a: the ring refuses windows) and DP 2 with the distributed optimizer reproduce the
single-process losses and gradient norms within 1e-5. One spawn of 2 ranks.
"""
from dataclasses import replace

import pytest

from tests.distributed.layouts import (Layout, check_losses, check_resume, model_fixtures,
                                       train_layouts)

GEMMA3 = ["--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--apply-layernorm-1p",
          "--sandwich-norm", "--qk-layernorm", "--softmax-scale", "0.2",
          "--glu-activation", "geglu_tanh", "--disable-bias-linear", "--embedding-multiplier",
          "8.0", "--kv-channels", "16", "--group-query-attention", "--num-query-groups", "2",
          "--position-embedding-type", "rope", "--rotary-base", "1000000",
          "--rotary-base-local", "10000", "--rotary-seq-len-interpolation-factor", "8",
          "--no-rope-scaling-local", "--window-size", "8", "--window-attn-skip-freq", "4"]
LAYOUTS = {
    "tp2-sequence-parallel": Layout(2, 1, 1, mbs=4, extra=GEMMA3 + ["--sequence-parallel"]),
    "pp2": replace(Layout(1, 2, 1, mbs=2, extra=GEMMA3), resume=True),
    "cp2-a2a": Layout(1, 1, 1, mbs=2, cp=2, extra=GEMMA3 + ["--cp-comm-type", "a2a"]),
    "dp2-distributed-optimizer": Layout(1, 1, 2, mbs=2,
                                        extra=GEMMA3 + ["--use-distributed-optimizer"]),
}


def _rank(rank, world_size, data_prefix, workdir):
    return train_layouts(LAYOUTS, world_size, data_prefix, workdir)


workdir, reference, spawns = model_fixtures("gemma3-layouts", LAYOUTS, GEMMA3, _rank)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gemma3_layout_losses_equal_one_process(name, reference, spawns):
    check_losses(name, LAYOUTS[name], spawns[2], reference)


def test_gemma3_pp2_resumes_exactly(workdir, spawns):
    check_resume("pp2", LAYOUTS["pp2"], spawns[2], workdir[1])
