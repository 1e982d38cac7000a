"""MoE checkpoints re-shard over expert parallelism with equal logits.

A small MoE model trains 2 iterations at EP 2 and saves (Megatron-LM's per-EP-rank
folders). tools/merge_mp_partitions.py merges it to EP 1, and splits that to EP 4
(and EP 2 x PP 2); --universal-checkpoint loads the EP 2 checkpoint at EP 4. The logits
of one token sequence agree within 1e-5 relative at EP 2, EP 1, EP 4 (from the file and
re-sharded in memory), and merging EP 4 back to EP 1 gives the EP 1 tensors exactly.
Spawns: 2 ranks (train, re-shard, EP 2 logits), 4 ranks (EP 4 logits).
"""
import os

import numpy as np
import pytest
import torch

from tests.distributed.run_ranks import run_ranks
from tests.gpt_setup import preprocess_wiki, tiny_gpt_argv


MOE = ["--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
       "--num-experts", "8", "--moe-router-topk", "2", "--moe-layer-freq", "2",
       "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "1e-2",
       "--moe-shared-expert-intermediate-size", "32", "--moe-token-dispatcher-type", "alltoall"]


def _merge(load, save, *target):
    from tools import merge_mp_partitions
    assert merge_mp_partitions.main(["--load", load, "--save", save, *target]) == 0


def load_model(root, pstate, universal=False):
    """This rank's model from the checkpoint at `root` (re-sharded in memory: `universal`)."""
    from megatron.checkpointing import api
    from megatron.checkpointing.formats import RunState
    from megatron.config import Config
    from megatron.model import GPTModel
    config = Config.from_dict(api.stored_state(root)["config"])
    config.checkpoint.universal_checkpoint = universal
    model = GPTModel(config.model, tp_group=pstate.tp_group, expert_groups=pstate.expert_groups())
    api.load(root, RunState([model], config, pstate))
    return model.eval()


def logits(root, pstate, universal=False, length=32):
    """Logits of a fixed sequence of `length` tokens from the checkpoint at `root`, on this
    rank's layout."""
    model = load_model(root, pstate, universal)
    tokens = (torch.arange(length) * 37 % 1000).view(1, length)
    with torch.no_grad():
        return model(tokens, torch.arange(length).view(1, length)).numpy()


def _world2(rank, world_size, prefix, out):
    import torch.distributed as dist
    import pretrain_gpt
    from megatron.mpu import initialize_model_parallel
    ep2 = os.path.join(out, "ep2")
    pretrain_gpt.main(tiny_gpt_argv(prefix, os.path.join(out, "cache"), *MOE,
                                    "--expert-model-parallel-size", "2", "--save", ep2,
                                    "--save-interval", "2", iters=2, mbs=2, gbs=4))
    if rank == 0:
        _merge(ep2, os.path.join(out, "ep1"))
        _merge(os.path.join(out, "ep1"), os.path.join(out, "ep4"),
               "--target-expert-model-parallel-size", "4")
        _merge(os.path.join(out, "ep1"), os.path.join(out, "ep2pp2"),
               "--target-expert-model-parallel-size", "2", "--target-pipeline-model-parallel-size", "2")
        _merge(os.path.join(out, "ep4"), os.path.join(out, "ep4-to-ep1"))
    dist.barrier()
    return logits(ep2, initialize_model_parallel(ep=2))


def _world4(rank, world_size, out):
    from megatron.mpu import initialize_model_parallel
    pstate = initialize_model_parallel(ep=4)
    return {"file": logits(os.path.join(out, "ep4"), pstate),
            "universal": logits(os.path.join(out, "ep2"), pstate, universal=True)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe-reshard")
    prefix = preprocess_wiki(out)
    ep2 = run_ranks(_world2, 2, prefix, str(out), timeout=900)
    ep4 = run_ranks(_world4, 4, str(out), timeout=900)
    return out, ep2, ep4


def _close(got, want, what):
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < 1e-5, f"{what}: logits differ by {rel:.3g} (relative to the largest)"


def test_ep_reshard_keeps_the_logits(runs):
    from megatron.mpu.parallel_state import single_process_state
    out, ep2, ep4 = runs
    want = logits(os.path.join(out, "ep1"), single_process_state())
    for rank, got in enumerate(ep2):
        _close(got, want, f"EP 2 rank {rank}")
    for rank, got in enumerate(ep4):
        _close(got["file"], want, f"EP 4 (merge_mp_partitions) rank {rank}")
        _close(got["universal"], want, f"EP 4 (--universal-checkpoint) rank {rank}")


def test_ep_folders_and_exact_round_trip(runs):
    from megatron.checkpointing.model_file import read_model_file
    out = runs[0]
    folders = sorted(os.listdir(os.path.join(out, "ep4", "iter_0000002")))
    assert folders == [f"mp_rank_00_{e:03d}" for e in range(4)]
    folders = sorted(os.listdir(os.path.join(out, "ep2pp2", "iter_0000002")))
    assert folders == [f"mp_rank_00_{p:03d}_{e:03d}" for p in range(2) for e in range(2)]
    one = read_model_file(os.path.join(out, "ep1", "iter_0000002", "mp_rank_00",
                                       "model_optim_rng.pt"))["model"]
    back = read_model_file(os.path.join(out, "ep4-to-ep1", "iter_0000002", "mp_rank_00",
                                        "model_optim_rng.pt"))["model"]
    flat_one, flat_back = _flatten(one), _flatten(back)
    assert flat_one.keys() == flat_back.keys()
    assert all(torch.equal(flat_one[k], flat_back[k]) for k in flat_one)
    experts = "language_model.encoder.layers.0.mlp.experts.linear_fc1.weight"
    assert flat_one[experts].shape[0] == 8


def _flatten(nested):
    from megatron.checkpointing.model_file import from_megatron_layout
    return from_megatron_layout(nested)
