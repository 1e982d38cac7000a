"""tools/estimate.py counts context parallelism: the activations one CP rank saves
(ring and all-to-all, CP 2) within 10% of what autograd holds, and the CP 2 estimate
of a long sequence below 0.55 of CP 1's."""
import pytest
import torch

from megatron.training.memory import Layout, estimate
from tests.distributed.run_ranks import run_ranks
from tests.unit.test_estimate import VOCAB, config_for

FLAGS = ("--use-rotary-position-embeddings", "--normalization", "RMSNorm", "--swiglu",
         "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
         "--seq-length", "256", "--max-position-embeddings", "256")


def _saved_bytes(model, tokens, positions):
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, positions, labels=tokens)
    return sum(saved.values())


def _rank(rank, world_size):
    from megatron.model import GPTModel
    from megatron.model.context_parallel import split_for_cp
    from megatron.model.transformer import enable_context_parallel
    from megatron.mpu import initialize_model_parallel
    out = {}
    for comm in ("p2p", "a2a"):
        config = config_for(*FLAGS, "--context-parallel-size", "2", "--cp-comm-type", comm,
                            world_size=2)
        pstate = initialize_model_parallel(1, 1, cp=2)
        model = GPTModel(config.model)
        enable_context_parallel(model, pstate.cp_group, comm)
        tokens = torch.randint(0, VOCAB, (2, 256), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(256).expand(2, 256)
        out[comm] = _saved_bytes(model, *(split_for_cp(t, pstate.cp_rank, 2)
                                          for t in (tokens, positions)))
    return out


def test_cp_activations_match_the_estimate():
    results = run_ranks(_rank, 2)
    for comm in ("p2p", "a2a"):
        config = config_for(*FLAGS, "--context-parallel-size", "2", "--cp-comm-type", comm,
                            world_size=2)
        predicted = estimate(config, Layout(world_size=2, device_type="cpu"))
        for measured in results:
            assert predicted["activations_per_micro_batch"] == pytest.approx(
                measured[comm], rel=0.10), (comm, predicted["activations_per_micro_batch"],
                                            measured[comm])


def test_cp2_halves_the_activations_of_a_long_sequence():
    long = ("--seq-length", "65536", "--max-position-embeddings", "65536")
    one = estimate(config_for(*FLAGS, *long), Layout(world_size=1, device_type="cpu"))
    two = estimate(config_for(*FLAGS, *long, "--context-parallel-size", "2", world_size=2),
                   Layout(world_size=2, device_type="cpu"))
    assert two["activations"] < 0.55 * one["activations"]
    assert two["parameters"] == one["parameters"]
