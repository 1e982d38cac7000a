"""Ring (p2p) and all-to-all context-parallel attention against one process: outputs
and the gradients of q, k, v, at CP 2 and 4, with grouped keys / values."""
import math

import pytest
import torch

from megatron.model.context_parallel import (a2a_attention, cp_token_index, ring_attention,
                                             split_for_cp)
from tests.distributed.run_ranks import run_ranks

S, B, HEADS, GROUPS, D = 32, 2, 4, 2, 8


def _inputs():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(S, B, HEADS, D, generator=gen)
    k, v = torch.randn(2, S, B, GROUPS, D, generator=gen)
    dout = torch.randn(S, B, HEADS * D, generator=gen)
    return q, k, v, dout


def _expand(t):
    return t.repeat_interleave(HEADS // GROUPS, dim=2)


def _causal(q, k, v, mask=None):
    """Reference attention [s, b, h, d] -> [s, b, h * d] (k / v with all heads)."""
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1),
                                float("-inf"))
    out = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v)
    return out.reshape(q.shape[0], q.shape[1], -1)


def _run(q, k, v, dout, attend):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _check(rank, world_size):
    import torch.distributed as dist
    group = dist.new_group(list(range(world_size)))
    q, k, v, dout = _inputs()
    expected = _run(q, k, v, dout, lambda q, k, v: _causal(q, _expand(k), _expand(v)))
    local = [split_for_cp(t, rank, world_size, dim=0) for t in (q, k, v, dout)]
    errors = {}
    attends = {"p2p": lambda q, k, v: ring_attention(q, k, v, group),
               "a2a": lambda q, k, v: a2a_attention(q, _expand(k), _expand(v), group, _causal)}
    for name, attend in attends.items():
        got = _run(*local, attend)
        want = [split_for_cp(t, rank, world_size, dim=0) for t in expected]
        errors[name] = max(float((g - w).abs().max()) for g, w in zip(got, want))
    return errors


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_and_a2a_attention_equal_one_process(cp):
    for errors in run_ranks(_check, cp):
        assert errors["p2p"] < 1e-5 and errors["a2a"] < 1e-5, errors


def test_split_holds_chunks_r_and_2cp_minus_1_minus_r():
    assert cp_token_index(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_token_index(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([cp_token_index(24, r, 3) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))
