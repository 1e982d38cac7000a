"""Pipelined forward/backward over gloo gives the losses and gradients of one process.

One spawn of 4 ranks runs, in turn: P=4 1F1B (with a loss scale, M > P and M < P), P=2 1F1B on
ranks {0,1} next to interleaved P=2 V=2 on ranks {2,3} (M = 2P and the all-warm-up M = P),
and forward-only evaluation of both layouts.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed.run_ranks import run_ranks

SEQ, MICRO, HIDDEN, LAYERS = 3, 2, 8, 8
TOL = 1e-6


class Block(nn.Module):
    """x + tanh(W x + b): ends in an add, like a transformer layer."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class Chunk(nn.Module):
    """Consecutive blocks of the stack; takes its input from set_input_tensor unless first."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def full_stack():
    torch.manual_seed(1234)
    return [Block() for _ in range(LAYERS)]


def microbatches(m):
    gen = torch.Generator().manual_seed(7)
    return [{"x": torch.randn(SEQ, MICRO, HIDDEN, generator=gen),
             "t": torch.randn(SEQ, MICRO, HIDDEN, generator=gen)} for _ in range(m)]


def mse(output, target):
    loss = ((output - target) ** 2).mean()
    return loss, {"lm loss": loss.detach()}


def reference(m, forward_only=False):
    """Losses and per-layer gradients of the whole stack with plain gradient accumulation."""
    blocks = full_stack()
    model = Chunk(blocks)
    losses = []
    for batch in microbatches(m):
        loss, _ = mse(model(batch["x"]), batch["t"])
        losses.append(loss.item())
        if not forward_only:
            (loss / m).backward()
    grads = [[p.grad for p in b.parameters()] for b in blocks]
    return losses, grads


def stage_chunks(pp_rank, pp_size, chunks):
    """The model chunks of one rank: virtual stage c * P + r holds an equal share of layers."""
    blocks = full_stack()
    per = LAYERS // (pp_size * chunks)
    owned = []
    for c in range(chunks):
        start = (c * pp_size + pp_rank) * per
        owned.append(list(range(start, start + per)))
    return [Chunk([copy.deepcopy(blocks[i]) for i in idx]) for idx in owned], owned


def make_forward_step(pp_rank, pp_size, chunks, sent_outputs):
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        c = model.chunk_index
        first = pp_rank == 0 and c == 0
        out = model(batch["x"] if first else model.input_tensor)
        if not (pp_rank == pp_size - 1 and c == chunks - 1):
            sent_outputs.append(out)
        return out, lambda output: mse(output, batch["t"])
    return forward_step


class Recorder:
    """Fake timers and no_sync that remember what the executor did."""

    def __init__(self):
        self.names, self.no_sync_entries = set(), 0

    def timers(self, name):
        self.names.add(name)
        return self

    def start(self):
        pass

    def stop(self):
        pass

    @contextlib.contextmanager
    def no_sync(self):
        self.no_sync_entries += 1
        yield


def run_case(rank, ranks, group, schedule, chunks, m, forward_only=False, scale=None):
    """Run one pipelined layout on `ranks` and compare this rank's stage with the reference."""
    from megatron.pipeline import P2PCommunicator, forward_backward

    pp_size, pp_rank = len(ranks), ranks.index(rank)
    ring = chunks > 1
    prev_rank = ranks[pp_rank - 1] if pp_rank > 0 or ring else None
    next_rank = ranks[(pp_rank + 1) % pp_size] if pp_rank < pp_size - 1 or ring else None
    sent, rec = [], Recorder()
    comm = P2PCommunicator(group, prev_rank, next_rank, (SEQ, MICRO, HIDDEN), torch.float32, "cpu",
                           timers=rec.timers)
    models, owned = stage_chunks(pp_rank, pp_size, chunks)
    for c, model in enumerate(models):
        model.chunk_index = c
    data = microbatches(m)
    losses = forward_backward(
        schedule, forward_step=make_forward_step(pp_rank, pp_size, chunks, sent),
        data_iterators=[iter(data) for _ in models], model_chunks=models, num_microbatches=m,
        comm=comm, pp_rank=pp_rank, pp_size=pp_size, forward_only=forward_only,
        no_sync=rec.no_sync, loss_scale=None if scale is None else torch.tensor(scale),
        timers=rec.timers)

    ref_losses, ref_grads = reference(m, forward_only)
    if pp_rank == pp_size - 1:
        got = [d["lm loss"].item() for d in losses]
        assert len(got) == m and max(abs(a - b) for a, b in zip(got, ref_losses)) <= TOL, \
            (got, ref_losses)
    else:
        assert losses == []
    for model, idx in zip(models, owned):
        for block, i in zip(model.blocks, idx):
            for p, ref in zip(block.parameters(), ref_grads[i]):
                if forward_only:
                    assert p.grad is None
                else:
                    diff = (p.grad / (scale or 1.0) - ref).abs().max().item()
                    assert diff <= TOL, (schedule, m, rank, i, diff)
    if not forward_only:
        assert rec.no_sync_entries == chunks * (m - 1), rec.no_sync_entries
        assert all(t.numel() == 1 for t in sent), "sent activations were not freed"
        assert "backward-compute" in rec.names
    return sorted(rec.names)


def _all_cases(rank, world_size):
    world = list(range(world_size))
    pair_a, pair_b = dist.new_group([0, 1]), dist.new_group([2, 3])
    names = []
    names += run_case(rank, world, None, "1f1b", 1, 8, scale=4.0)
    names += run_case(rank, world, None, "1f1b", 1, 2)
    mine, group = ([0, 1], pair_a) if rank < 2 else ([2, 3], pair_b)
    if rank < 2:
        names += run_case(rank, mine, group, "1f1b", 1, 3)
        names += run_case(rank, mine, group, "1f1b", 1, 3, forward_only=True)
    else:
        names += run_case(rank, mine, group, "interleaved", 2, 4)
        names += run_case(rank, mine, group, "interleaved", 2, 2)
        names += run_case(rank, mine, group, "interleaved", 2, 4, forward_only=True)
    dist.barrier()
    names += run_case(rank, world, None, "1f1b", 1, 4, forward_only=True)
    return sorted(set(names))


def test_pipeline_matches_single_process():
    names = run_ranks(_all_cases, 4, timeout=240)
    assert "forward-send-backward-recv" in names[1]  # middle stages use combined exchanges
    assert "backward-send-forward-recv" in names[2]
    assert "forward-backward-send-forward-backward-recv" in names[3]  # interleaved steady


def test_no_pipelining_single_process():
    """Schedule 'none' on one process equals the reference too (no process group needed)."""
    from megatron.pipeline import forward_backward

    models, _ = stage_chunks(0, 1, 1)
    models[0].chunk_index = 0
    losses = forward_backward("none", forward_step=make_forward_step(0, 1, 1, []),
                              data_iterators=[iter(microbatches(3))], model_chunks=models,
                              num_microbatches=3, comm=None, pp_rank=0, pp_size=1)
    ref_losses, ref_grads = reference(3)
    assert [d["lm loss"].item() for d in losses] == ref_losses
    for block, ref in zip(models[0].blocks, ref_grads):
        for p, g in zip(block.parameters(), ref):
            assert torch.allclose(p.grad, g, atol=TOL, rtol=0)


def test_p2p_and_executor_errors():
    """Bad input is refused with a message before anything is sent (no process group needed)."""
    from megatron.pipeline import P2PCommunicator, forward_backward
    from megatron.pipeline.p2p import exchange_name

    assert exchange_name(True, False, False, True) == "forward-send-backward-recv"
    assert exchange_name(False, False, True, False) == "forward-recv"
    assert exchange_name(True, True, True, True) == "forward-backward-send-forward-backward-recv"
    comm = P2PCommunicator(None, None, 1, (2, 3), torch.float32, "cpu")
    assert comm.exchange() == (None, None)
    with pytest.raises(ValueError, match=r"sending a \(3, 2\).*moves \(2, 3\)"):
        comm.send_forward(torch.zeros(3, 2))
    with pytest.raises(ValueError, match="no previous rank"):
        comm.recv_forward()
    models, _ = stage_chunks(0, 1, 1)
    kwargs = dict(forward_step=None, model_chunks=models, num_microbatches=2, pp_rank=0)
    with pytest.raises(ValueError, match="got 2 data iterators for 1 model chunks"):
        forward_backward("1f1b", data_iterators=[None, None], comm=comm, pp_size=2, **kwargs)
    with pytest.raises(ValueError, match="pp_size=2 needs a P2PCommunicator"):
        forward_backward("1f1b", data_iterators=[None], comm=None, pp_size=2, **kwargs)
