"""--ckpt-format torch_dist with experts split over expert parallelism (issue 20).

A Mixtral-style MoE model (4 experts, top 2, every layer MoE, RoPE / RMSNorm / SwiGLU / GQA)
trains 5 iterations at EP 2 in a world of 4 (expert-DP 2, distributed optimizer) and saves
in torch_dist: expert tensors are Megatron-Core's `decoder.layers.mlp.experts.experts.*` of
shape [L, E, ...], each EP rank writing its experts at their global expert offsets. Resumed
at EP 1 (regular optimizer), EP 4 and EP 2 x TP 2 (distributed optimizer), iterations 6-10
give the losses of an uninterrupted run at that layout within 1e-5 (optimizer state
re-sharded with the experts). tools/merge_mp_partitions.py --ckpt-format torch (to EP 1
and to EP 2's per-EP-rank folders) and the reader of tools/convert_checkpoint.py --to hf
take the EP 2 torch_dist checkpoint directly and give what they give from the same run
saved in the torch format. One spawn of 4 gloo ranks.
"""
import os

import pytest
import torch

from tests.distributed.layouts import ITERS, SAVE_AT, Layout, assert_close, train
from tests.distributed.run_ranks import run_ranks
from tests.distributed.test_spec_layouts import ARCHS
from tests.gpt_setup import preprocess_wiki


DIST = ["--ckpt-format", "torch_dist"]
MOE = ARCHS["llama"] + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size",
                        "32", "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type",
                        "alltoall"]
DISTOPT = ["--use-distributed-optimizer"]


def _ep(n, *more):
    return MOE + ["--expert-model-parallel-size", str(n), *more]


SAVED = Layout(1, 1, 4, mbs=2, extra=_ep(2, *DISTOPT))
TARGETS = {"ep1": Layout(1, 1, 4, mbs=2, extra=_ep(1)),
           "ep4": Layout(1, 1, 4, mbs=2, extra=_ep(4, *DISTOPT)),
           "ep2-tp2": Layout(2, 1, 2, mbs=2, extra=_ep(2, *DISTOPT))}


def _rank(rank, world_size, prefix, workdir):
    cache = os.path.join(workdir, "cache")
    stop = ["--save-interval", str(SAVE_AT), "--exit-interval", str(SAVE_AT)]
    out = {"first": train(SAVED.argv(prefix, cache, *DIST, "--save",
                                     os.path.join(workdir, "dist"), *stop))}
    train(SAVED.argv(prefix, cache, "--save", os.path.join(workdir, "torch"), *stop))
    for name, layout in TARGETS.items():
        out[name] = train(layout.argv(prefix, cache))
        out[f"{name}/resumed"] = train(layout.argv(prefix, cache, *DIST, "--load",
                                                   os.path.join(workdir, "dist")))
    return out


def _convert(workdir):
    """The tools, in this (plain) process."""
    from tools import merge_mp_partitions
    j = lambda name: os.path.join(workdir, name)  # noqa: E731
    assert merge_mp_partitions.main(["--load", j("dist"), "--save", j("dist-to-torch"),
                                     "--ckpt-format", "torch"]) == 0
    assert merge_mp_partitions.main(["--load", j("torch"), "--save", j("torch-ep1")]) == 0
    assert merge_mp_partitions.main(["--load", j("dist"), "--save", j("dist-to-torch-ep2"),
                                     "--ckpt-format", "torch",
                                     "--target-expert-model-parallel-size", "2"]) == 0


@pytest.fixture(scope="module")
def spawn4(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch-dist-moe")
    prefix = preprocess_wiki(out, docs=40)
    results = run_ranks(_rank, 4, prefix, str(out), timeout=1800)
    _convert(str(out))
    return results, str(out)


@pytest.mark.parametrize("name", list(TARGETS))
def test_ep2_checkpoint_resumes_at_another_expert_layout(name, spawn4):
    results, _ = spawn4
    for rank in range(TARGETS[name].world):
        full, resumed = results[rank][name], results[rank][f"{name}/resumed"]
        assert full["iterations"] == list(range(1, ITERS + 1))
        assert resumed["iterations"] == list(range(SAVE_AT + 1, ITERS + 1))
        assert_close(resumed["losses"], full["losses"][SAVE_AT:], f"{name} resumed")
        assert_close(results[rank]["first"]["losses"], full["losses"][:SAVE_AT], f"{name} first")


def test_ep2_experts_have_megatron_core_keys_and_global_shapes(spawn4):
    from megatron.checkpointing.torch_dist import SafeReader
    _, out = spawn4
    folder = os.path.join(out, "dist", f"iter_{SAVE_AT:07d}")
    saved = SafeReader(folder).read_metadata().state_dict_metadata
    fc1 = saved["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert list(fc1.size) == [4, 4, 2 * 32, 64]  # [layers, experts, gate + up, hidden]
    offsets = sorted(tuple(c.offsets) for c in fc1.chunks)
    assert offsets == [(layer, expert, 0, 0) for layer in range(4) for expert in (0, 2)]
    assert "optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc2.weight" in saved
    assert list(saved["decoder.layers.mlp.router.weight"].size) == [4, 4, 64]


def test_merge_and_hf_export_read_an_ep2_torch_dist_checkpoint(spawn4):
    from megatron.checkpointing import api
    from megatron.checkpointing.hf import convert as hf_convert
    _, out = spawn4
    full = {root: api.read_model(os.path.join(out, root))[0]
            for root in ("dist-to-torch", "dist-to-torch-ep2", "torch-ep1")}
    assert os.path.isdir(os.path.join(out, "dist-to-torch-ep2", f"iter_{SAVE_AT:07d}",
                                      "mp_rank_00_001"))
    for converted in ("dist-to-torch", "dist-to-torch-ep2"):
        assert set(full[converted]) == set(full["torch-ep1"])
        for name, tensor in full["torch-ep1"].items():
            assert torch.equal(full[converted][name], tensor), (converted, name)
    # what tools/convert_checkpoint.py --to hf reads
    read = [hf_convert.read_full_model(os.path.join(out, s))[0] for s in ("dist", "torch-ep1")]
    assert set(read[0]) == set(read[1])
    for name, tensor in read[1].items():
        assert torch.equal(read[0][name], tensor), name
