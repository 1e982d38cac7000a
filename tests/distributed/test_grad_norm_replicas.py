"""The gradient norm counts the k / v replicas of TP above the query groups once.

When TP exceeds the number of query groups, TP ranks of one replica set hold the same
k / v rows of the fused QKV weight; the global norm counts them on the first rank of
each set only (megatron.mpu.sharding.duplicated_tail), so clipping (--clip-grad 1.0,
active at every one of the 10 iterations: the single-process norms are all above 1)
gives the single-process run. LLaMA-style with 2 query groups at TP 4, and with one
query group at TP 2 x PP 2 and at TP 2 x DP 2 with the distributed optimizer: losses
and gradient norms of 10 iterations within 1e-5 of one process. One spawn of 4 ranks.
"""
import os

import pytest

from tests.distributed.layouts import ITERS, Layout, assert_close, train
from tests.distributed.run_ranks import run_ranks
from tests.distributed.test_spec_layouts import ARCHS
from tests.gpt_setup import one_thread, wiki_workdir


CLIP = ["--clip-grad", "1.0"]
GQA = ARCHS["llama"] + CLIP  # 2 query groups
MQA = GQA + ["--num-query-groups", "1"]  # the last value wins
LAYOUTS = {
    "gqa/tp4": (GQA, Layout(4, 1, 1, mbs=2, extra=GQA)),
    "mqa/tp2-pp2": (MQA, Layout(2, 2, 1, mbs=2, extra=MQA)),
    "mqa/tp2-dp2-distributed-optimizer": (MQA, Layout(2, 1, 2, mbs=2, extra=MQA + [
        "--use-distributed-optimizer"])),
}


def _rank(rank, world_size, prefix, workdir):
    cache = os.path.join(workdir, "cache")
    return {name: train(layout.argv(prefix, cache)) for name, (_, layout) in LAYOUTS.items()}


workdir = wiki_workdir("grad-norm-replicas", docs=40)


@pytest.fixture(scope="module")
def references(workdir):
    prefix, out = workdir
    refs = {}
    for arch, flags in (("gqa", GQA), ("mqa", MQA)):
        with one_thread():
            refs[arch] = train(Layout(1, 1, 1, mbs=2, extra=flags).argv(prefix, out / "cache"))
    return refs


@pytest.fixture(scope="module")
def spawn4(workdir):
    prefix, out = workdir
    return run_ranks(_rank, 4, prefix, str(out), timeout=900)


def test_clipping_is_active(references):
    for arch, ref in references.items():
        assert len(ref["grad norms"]) == ITERS and min(ref["grad norms"]) > 1.0, (arch, ref)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_losses_and_grad_norms_equal_one_process(name, references, spawn4):
    layout = LAYOUTS[name][1]
    want = references[name.split("/")[0]]
    last = [r for r in range(layout.world) if layout.is_last_stage(r)]
    for rank in last:
        got = spawn4[rank][name]
        assert got["iterations"] == list(range(1, ITERS + 1)), f"rank {rank}"
        assert_close(got["grad norms"], want["grad norms"], f"{name} rank {rank} grad norms")
        assert_close(got["losses"], want["losses"], f"{name} rank {rank} losses")
