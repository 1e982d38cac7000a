"""LLaMA- and BLOOM-style models train like one device at every layout and resume exactly.

LLaMA-style: RoPE, RMSNorm, SwiGLU, grouped-query attention with 2 groups, untied
output layer, no biases. BLOOM-style: ALiBi and the embedding layer norm. With the
machinery of test_layouts (tests/distributed/layouts.py): 10 iterations at TP 2
(selective recomputation), PP 2 (full recomputation), TP 2 + sequence parallelism,
DP 2 with the distributed optimizer and interleaved PP reproduce the single-process
losses within 1e-5; LLaMA saved at iteration 5 at PP 2 and BLOOM with the distributed
optimizer resume bit for bit, and their checkpoints carry the sharding metadata.
One spawn of 2 ranks.
"""
import os
from dataclasses import replace

import pytest

from megatron.checkpointing.megatron_legacy import safe_load
from tests.distributed.layouts import (Layout, check_losses, check_resume, checkpoint_dir,
                                       reference_run, train_layouts)
from tests.distributed.run_ranks import run_ranks
from tests.gpt_setup import wiki_workdir


ARCHS = {
    "llama": ["--use-rotary-position-embeddings", "--normalization", "RMSNorm", "--swiglu",
              "--group-query-attention", "--num-query-groups", "2",
              "--untie-embeddings-and-output-weights", "--disable-bias-linear"],
    "bloom": ["--position-embedding-type", "alibi", "--embed-layernorm"],
}
RESUMES = {"llama": "pp2", "bloom": "dp2-distributed-optimizer"}


def _layouts(arch):
    flags = ARCHS[arch]
    table = {
        "tp2": Layout(2, 1, 1, mbs=2, extra=flags + ["--recompute-granularity", "selective"]),
        "pp2": Layout(1, 2, 1, mbs=2, extra=flags + ["--checkpoint-activations"]),
        "tp2-sequence-parallel": Layout(2, 1, 1, mbs=4, extra=flags + ["--sequence-parallel"]),
        "dp2-distributed-optimizer": Layout(1, 1, 2, mbs=2,
                                            extra=flags + ["--use-distributed-optimizer"]),
        "pp2-interleaved": Layout(1, 2, 1, mbs=1,
                                  extra=flags + ["--num-layers-per-virtual-pipeline-stage", "1"]),
    }
    resume = RESUMES[arch]
    table[resume] = replace(table[resume], resume=True)
    return {f"{arch}/{name}": layout for name, layout in table.items()}


LAYOUTS = {**_layouts("llama"), **_layouts("bloom")}


def _rank(rank, world_size, data_prefix, workdir):
    return train_layouts(LAYOUTS, world_size, data_prefix, workdir)


workdir = wiki_workdir("spec-layouts")


@pytest.fixture(scope="module")
def references(workdir):
    prefix, out = workdir
    return {arch: reference_run(prefix, out / "cache-ref", *flags)
            for arch, flags in ARCHS.items()}


@pytest.fixture(scope="module")
def spawn2(workdir):
    prefix, out = workdir
    return run_ranks(_rank, 2, prefix, str(out), timeout=900)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_spec_layout_losses_equal_one_device(name, references, spawn2):
    check_losses(name, LAYOUTS[name], spawn2, references[name.split("/")[0]])


@pytest.mark.parametrize("name", [n for n, layout in LAYOUTS.items() if layout.resume])
def test_spec_checkpoint_resumes_exactly(name, workdir, spawn2):
    layout = LAYOUTS[name]
    check_resume(name, layout, spawn2, workdir[1])
    folder = os.path.join(checkpoint_dir(workdir[1], name), "iter_0000005")
    state = safe_load(os.path.join(folder, sorted(os.listdir(folder))[-1], "model_optim_rng.pt"))
    sharding = state["sharding"]
    layer = "language_model.encoder.layers.0."
    assert sharding[layer + "self_attention.query_key_value.weight"]["dim"] == 0
    assert sharding[layer + "self_attention.dense.weight"]["dim"] == 1
    if name.startswith("llama"):
        assert sharding[layer + "mlp.dense_h_to_4h.weight"]["groups"] == 2
        assert sharding[layer + "self_attention.query_key_value.weight"]["query_groups"] == 2
        assert sharding["language_model.output_layer.weight"] == {"dim": 0, "groups": 1}
