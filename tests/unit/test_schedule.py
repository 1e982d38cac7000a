"""Pure tests of the pipeline schedules: ordering, send/recv pairing, deadlock freedom, memory."""
from __future__ import annotations

import itertools

import pytest

from megatron.pipeline.schedule import (
    Action, Exchange, Kind, build_schedule, interleaved_num_warmup, interleaved_one_f_one_b,
    interleaved_order, no_pipelining, one_f_one_b,
)

F, B = Kind.FORWARD, Kind.BACKWARD
SF, RF, SB, RB = Kind.SEND_FORWARD, Kind.RECV_FORWARD, Kind.SEND_BACKWARD, Kind.RECV_BACKWARD

ONE_F_ONE_B_CASES = [(p, m) for p in (1, 2, 3, 4, 5) for m in (1, 2, 3, 4, 5, 8, 9)]
INTERLEAVED_CASES = [(p, v, m) for p in (2, 3, 4) for v in (1, 2, 3) for m in (p, 2 * p, 3 * p)]


# ---------------------------------------------------------------------------
# A small pipeline simulator
# ---------------------------------------------------------------------------

def _peer(rank: int, kind: Kind, size: int) -> int:
    return (rank + 1) % size if kind.goes_to_next else (rank - 1) % size


def _link_ops(schedules):
    """Per rank and step: the ops as (link, seq, action); seq counts per physical link."""
    size = len(schedules)
    sent, received = {}, {}
    ops = []
    for rank, steps in enumerate(schedules):
        rank_ops = []
        for step in steps:
            if isinstance(step, Action):
                rank_ops.append(None)
                continue
            step_ops = []
            for t in step.transfers:
                peer = _peer(rank, t.kind, size)
                link = (rank, peer) if t.kind.is_send else (peer, rank)
                counter = sent if t.kind.is_send else received
                seq = counter.get(link, 0)
                counter[link] = seq + 1
                step_ops.append((link, seq, t))
            rank_ops.append(step_ops)
        ops.append(rank_ops)
    return ops


def simulate(schedules):
    """Run all ranks with rendezvous p2p (an op completes only when both sides have posted it).

    Returns (messages, compute order per rank); raises AssertionError on deadlock.
    Messages: {(link, seq): (send action, recv action)}.
    """
    ops = _link_ops(schedules)
    pcs = [0] * len(schedules)
    done = [set() for _ in schedules]
    messages, order = {}, [[] for _ in schedules]
    while True:
        progress = False
        posted = {}
        for rank, pc in enumerate(pcs):
            while pc < len(schedules[rank]) and ops[rank][pc] is None:
                order[rank].append(schedules[rank][pc])
                pc += 1
                progress = True
            pcs[rank] = pc
            if pc < len(schedules[rank]):
                for link, seq, t in ops[rank][pc]:
                    posted[(link, seq, t.kind.is_send)] = (rank, t)
        for (link, seq, is_send), (rank, t) in posted.items():
            other = posted.get((link, seq, not is_send))
            if is_send and other is not None:
                messages[(link, seq)] = (t, other[1])
                done[rank].add((link, seq, True))
                done[other[0]].add((link, seq, False))
        for rank, pc in enumerate(pcs):
            if pc < len(schedules[rank]) and all((l, s, t.kind.is_send) in done[rank]
                                                 for l, s, t in ops[rank][pc]):
                pcs[rank] += 1
                progress = True
        if all(pc == len(s) for pc, s in zip(pcs, schedules)):
            return messages, order
        assert progress, f"deadlock: ranks stuck at steps {pcs}"


def check_pipeline(schedules, chunks: int, microbatches: int):
    """All the structural checks for one whole pipeline; returns peak in-flight per rank."""
    size = len(schedules)
    messages, order = simulate(schedules)
    for (link, _), (send, recv) in messages.items():
        src, dst = link
        if send.kind == SF:
            expected = (RF, send.microbatch, send.chunk + (1 if src == size - 1 else 0))
        else:
            assert send.kind == SB, send
            expected = (RB, send.microbatch, send.chunk - (1 if src == 0 else 0))
        assert (recv.kind, recv.microbatch, recv.chunk) == expected, (link, send, recv)
    sends = sum(1 for s in schedules for st in s if isinstance(st, Exchange)
                for t in st.transfers if t.kind.is_send)
    assert sends == len(messages)  # every send met its receive, none left over
    return [_check_rank_order(rank, size, steps, chunks, microbatches)
            for rank, steps in enumerate(schedules)]


def _check_rank_order(rank, size, steps, chunks, microbatches):
    """Per-rank order: recv -> forward -> send; forward before backward; returns peak in-flight."""
    seen = []
    for step in steps:
        seen += [step] if isinstance(step, Action) else list(step.transfers)
    index = {(a.kind, a.microbatch, a.chunk): i for i, a in enumerate(seen)}
    assert len(index) == len(seen), "an action appears twice"
    in_flight = peak = 0
    for a in seen:
        in_flight += {F: 1, B: -1}.get(a.kind, 0)
        peak = max(peak, in_flight)
    for mb, c in itertools.product(range(microbatches), range(chunks)):
        first = rank == 0 and c == 0
        last = rank == size - 1 and c == chunks - 1
        f, b = index[(F, mb, c)], index[(B, mb, c)]
        assert f < b
        assert first or index[(RF, mb, c)] < f
        assert last or f < index[(SF, mb, c)]
        assert last or index[(RB, mb, c)] < b
        assert first or b < index[(SB, mb, c)]
        assert not first or (RF, mb, c) not in index and (SB, mb, c) not in index
        assert not last or (SF, mb, c) not in index and (RB, mb, c) not in index
    assert len(seen) == len(index)
    return peak


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------

def test_no_pipelining():
    assert no_pipelining(2) == [Action(F, 0), Action(B, 0), Action(F, 1), Action(B, 1)]
    assert no_pipelining(2, forward_only=True) == [Action(F, 0), Action(F, 1)]


def test_one_f_one_b_middle_rank_exact():
    """P=3, rank 1, M=3: one warm-up forward, steady with combined exchanges, one cool-down."""
    ex = lambda *a: Exchange(tuple(a))  # noqa: E731
    assert one_f_one_b(1, 3, 3) == [
        ex(Action(RF, 0)), Action(F, 0), ex(Action(SF, 0)),
        ex(Action(RF, 1)),
        Action(F, 1), ex(Action(SF, 1), Action(RB, 0)), Action(B, 0), ex(Action(RF, 2), Action(SB, 0)),
        Action(F, 2), ex(Action(SF, 2), Action(RB, 1)), Action(B, 1), ex(Action(SB, 1)),
        ex(Action(RB, 2)), Action(B, 2), ex(Action(SB, 2)),
    ]


@pytest.mark.parametrize("p,m", ONE_F_ONE_B_CASES)
def test_one_f_one_b_pipeline(p, m):
    peaks = check_pipeline([one_f_one_b(r, p, m) for r in range(p)], 1, m)
    assert peaks == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("p,v,m", INTERLEAVED_CASES)
def test_interleaved_pipeline(p, v, m):
    peaks = check_pipeline([interleaved_one_f_one_b(r, p, v, m) for r in range(p)], v, m)
    total = m * v
    for r, peak in enumerate(peaks):
        megatron_bound = total if m == p else min((p - r - 1) * 2 + (v - 1) * p + 1, total)
        assert peak == megatron_bound, (r, peak)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (3, 2, 3), (4, 3, 8), (2, 1, 2)])
def test_forward_only_pipelines(p, v, m):
    cases = [([one_f_one_b(r, p, m, forward_only=True) for r in range(p)], 1),
             ([interleaved_one_f_one_b(r, p, v, m, forward_only=True) for r in range(p)], v)]
    for schedules, chunks in cases:
        messages, order = simulate(schedules)
        assert messages and all(s.kind == SF and r.kind == RF for s, r in messages.values())
        for rank_order in order:
            assert [a.kind for a in rank_order] == [F] * (m * chunks)
            assert {(a.microbatch, a.chunk) for a in rank_order} == set(
                itertools.product(range(m), range(chunks)))


def test_interleaved_order_matches_megatron():
    fwd = [interleaved_order(k, 2, 2, True) for k in range(8)]
    assert fwd == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    bwd = [interleaved_order(k, 2, 2, False) for k in range(4)]
    assert bwd == [(0, 1), (1, 1), (0, 0), (1, 0)]
    assert interleaved_num_warmup(0, 4, 2, 8) == 3 * 2 + 4
    assert interleaved_num_warmup(3, 4, 2, 8) == 4
    assert interleaved_num_warmup(0, 4, 3, 4) == 12  # M == P: all warm-up
    assert interleaved_num_warmup(0, 4, 1, 8) == 6


def test_simulator_detects_deadlock():
    """Posting the steady receive before the send (separately) must deadlock the simulation."""
    def broken(rank):
        steps = []
        for step in one_f_one_b(rank, 3, 4):
            if isinstance(step, Exchange) and len(step.transfers) == 2:
                recvs = [t for t in step.transfers if not t.kind.is_send]
                sends = [t for t in step.transfers if t.kind.is_send]
                steps += [Exchange((t,)) for t in recvs + sends]
            else:
                steps.append(step)
        return steps
    with pytest.raises(AssertionError, match="deadlock"):
        simulate([broken(r) for r in range(3)])


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"num_microbatches \(6\).*pp_size \(4\)"):
        interleaved_one_f_one_b(0, 4, 2, 6)
    with pytest.raises(ValueError, match="pp_rank=4"):
        one_f_one_b(4, 4, 8)
    with pytest.raises(ValueError, match="num_microbatches must be a positive"):
        one_f_one_b(0, 4, 0)
    with pytest.raises(ValueError, match="pp_size >= 2"):
        interleaved_one_f_one_b(0, 1, 2, 2)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'gpipe'"):
        build_schedule("gpipe", 0, 2, 1, 4)
    with pytest.raises(ValueError, match="'1f1b' needs one model chunk"):
        build_schedule("1f1b", 0, 2, 2, 4)
    assert build_schedule("none", 0, 1, 1, 2) == no_pipelining(2)
