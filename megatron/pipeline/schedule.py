"""Pipeline schedules as pure data: the ordered list of steps one stage runs.

A schedule is a list of steps for one pipeline rank. A step is either

* an :class:`Action` of kind ``FORWARD`` or ``BACKWARD`` (compute on one
  micro-batch of one model chunk), or
* an :class:`Exchange`: a group of transfers (``SEND_FORWARD``, ``RECV_FORWARD``,
  ``SEND_BACKWARD``, ``RECV_BACKWARD``) posted together and waited on together,
  which the p2p layer turns into one ``batch_isend_irecv`` call.

Every transfer is labelled with the (micro-batch, chunk) it belongs to on the
rank that runs it: a ``SEND_FORWARD`` carries the output of that forward, a
``RECV_FORWARD`` the input of that forward, a ``SEND_BACKWARD`` the input
gradient of that backward and a ``RECV_BACKWARD`` the output gradient it needs.

Neighbours: with one chunk per rank the stages form a line (rank ``r`` sends
activations to ``r + 1``). With ``V`` chunks per rank (interleaved) virtual
stage ``c * P + r`` lives on rank ``r`` as chunk ``c``, so rank ``P - 1`` chunk
``c`` feeds rank ``0`` chunk ``c + 1`` (a ring).

Transfers to a missing neighbour (first / last virtual stage) are simply left
out. Within one exchange the transfers are ordered by :func:`transfer_order`:
activations (send to next, receive from previous) before gradients (send to
previous, receive from next). When two ranks are both previous and next of each
other (``P == 2`` interleaved) this keeps the messages on the one link between
them in the same order on both sides, which NCCL needs (it ignores tags).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Union


class Kind(str, enum.Enum):
    """What one action does."""

    FORWARD = "forward"
    BACKWARD = "backward"
    SEND_FORWARD = "send_forward"
    RECV_FORWARD = "recv_forward"
    SEND_BACKWARD = "send_backward"
    RECV_BACKWARD = "recv_backward"

    @property
    def is_compute(self) -> bool:
        """True for FORWARD and BACKWARD."""
        return self in (Kind.FORWARD, Kind.BACKWARD)

    @property
    def is_send(self) -> bool:
        """True for the two send kinds."""
        return self in (Kind.SEND_FORWARD, Kind.SEND_BACKWARD)

    @property
    def goes_to_next(self) -> bool:
        """True when the peer of this transfer is the next pipeline rank."""
        return self in (Kind.SEND_FORWARD, Kind.RECV_BACKWARD)


@dataclass(frozen=True)
class Action:
    """One compute step or one transfer, for ``microbatch`` of model ``chunk``."""

    kind: Kind
    microbatch: int
    chunk: int = 0


@dataclass(frozen=True)
class Exchange:
    """Transfers posted together and completed together (one batched p2p call)."""

    transfers: tuple[Action, ...]

    def find(self, kind: Kind) -> Action | None:
        """The transfer of ``kind`` in this exchange, or None."""
        for transfer in self.transfers:
            if transfer.kind == kind:
                return transfer
        return None


Step = Union[Action, Exchange]

_TRANSFER_ORDER = (Kind.SEND_FORWARD, Kind.RECV_FORWARD, Kind.SEND_BACKWARD, Kind.RECV_BACKWARD)


def transfer_order(kind: Kind) -> int:
    """Position of a transfer kind inside an exchange (activations before gradients)."""
    return _TRANSFER_ORDER.index(kind)


def _exchange(*transfers: Action | None) -> list[Step]:
    """A one-element list holding an Exchange of the given transfers, or [] if none."""
    present = sorted((t for t in transfers if t is not None), key=lambda t: transfer_order(t.kind))
    return [Exchange(tuple(present))] if present else []


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_rank(pp_rank: int, pp_size: int) -> None:
    _check_positive(pp_size=pp_size)
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} must be in [0, pp_size={pp_size})")


# ---------------------------------------------------------------------------
# No pipelining
# ---------------------------------------------------------------------------

def no_pipelining(num_microbatches: int, forward_only: bool = False) -> list[Step]:
    """Forward then backward of each micro-batch in turn, on a single stage."""
    _check_positive(num_microbatches=num_microbatches)
    steps: list[Step] = []
    for mb in range(num_microbatches):
        steps.append(Action(Kind.FORWARD, mb))
        if not forward_only:
            steps.append(Action(Kind.BACKWARD, mb))
    return steps


# ---------------------------------------------------------------------------
# 1F1B (PipeDream-flush)
# ---------------------------------------------------------------------------

def num_warmup_microbatches(pp_rank: int, pp_size: int, num_microbatches: int) -> int:
    """Forwards that 1F1B runs on ``pp_rank`` before its first backward."""
    return min(pp_size - pp_rank - 1, num_microbatches)


def one_f_one_b(pp_rank: int, pp_size: int, num_microbatches: int,
                forward_only: bool = False) -> list[Step]:
    """The 1F1B schedule of one rank: warm-up forwards, steady 1F1B, cool-down backwards.

    In the steady state the send of an output and the receive of the next
    gradient (and the send of an input gradient and the receive of the next
    activation) share one exchange, so neighbours never wait on each other
    in a cycle.
    """
    _check_rank(pp_rank, pp_size)
    _check_positive(num_microbatches=num_microbatches)
    first, last = pp_rank == 0, pp_rank == pp_size - 1

    def recv_f(mb: int) -> Action | None:
        return None if first else Action(Kind.RECV_FORWARD, mb)

    def send_f(mb: int) -> Action | None:
        return None if last else Action(Kind.SEND_FORWARD, mb)

    def recv_b(mb: int) -> Action | None:
        return None if last else Action(Kind.RECV_BACKWARD, mb)

    def send_b(mb: int) -> Action | None:
        return None if first else Action(Kind.SEND_BACKWARD, mb)

    if forward_only:
        steps: list[Step] = []
        for mb in range(num_microbatches):
            steps += _exchange(recv_f(mb)) + [Action(Kind.FORWARD, mb)] + _exchange(send_f(mb))
        return steps

    warmup = num_warmup_microbatches(pp_rank, pp_size, num_microbatches)
    steady = num_microbatches - warmup
    steps = []
    for mb in range(warmup):
        steps += _exchange(recv_f(mb)) + [Action(Kind.FORWARD, mb)] + _exchange(send_f(mb))
    if steady > 0:
        steps += _exchange(recv_f(warmup))
    for i in range(steady):
        fwd = warmup + i
        steps.append(Action(Kind.FORWARD, fwd))
        steps += _exchange(send_f(fwd), recv_b(i))
        steps.append(Action(Kind.BACKWARD, i))
        next_input = recv_f(fwd + 1) if i < steady - 1 else None
        steps += _exchange(send_b(i), next_input)
    for mb in range(steady, num_microbatches):
        steps += _exchange(recv_b(mb)) + [Action(Kind.BACKWARD, mb)] + _exchange(send_b(mb))
    return steps


# ---------------------------------------------------------------------------
# Interleaved 1F1B (virtual pipeline stages)
# ---------------------------------------------------------------------------

def interleaved_num_warmup(pp_rank: int, pp_size: int, num_model_chunks: int,
                           num_microbatches: int) -> int:
    """Forwards (over all chunks) the interleaved schedule runs before its first backward.

    ``(P - rank - 1) * 2 + (V - 1) * P``, capped at ``M * V``; when ``M == P``
    every forward is a warm-up forward.
    """
    total = num_microbatches * num_model_chunks
    if num_microbatches == pp_size:
        return total
    return min((pp_size - pp_rank - 1) * 2 + (num_model_chunks - 1) * pp_size, total)


def interleaved_order(k: int, pp_size: int, num_model_chunks: int,
                      forward: bool) -> tuple[int, int]:
    """(micro-batch, chunk) of the ``k``-th forward (or backward) of a rank.

    Micro-batches go in groups of ``P``: the group runs through chunk 0, then
    chunk 1, ... (backwards: the last chunk first).
    """
    group_size = pp_size * num_model_chunks
    chunk = (k % group_size) // pp_size
    if not forward:
        chunk = num_model_chunks - 1 - chunk
    microbatch = (k // group_size) * pp_size + k % pp_size
    return microbatch, chunk


class _Labeller:
    """Names received tensors: the j-th one a chunk receives is micro-batch j."""

    def __init__(self, num_model_chunks: int):
        self.forward = [0] * num_model_chunks
        self.backward = [0] * num_model_chunks

    def recv_forward(self, chunk: int) -> Action:
        mb, self.forward[chunk] = self.forward[chunk], self.forward[chunk] + 1
        return Action(Kind.RECV_FORWARD, mb, chunk)

    def recv_backward(self, chunk: int) -> Action:
        mb, self.backward[chunk] = self.backward[chunk], self.backward[chunk] + 1
        return Action(Kind.RECV_BACKWARD, mb, chunk)


@dataclass(frozen=True)
class _Shape:
    """The sizes an interleaved schedule is built from."""

    rank: int
    size: int
    chunks: int
    microbatches: int

    @property
    def total(self) -> int:
        return self.microbatches * self.chunks

    @property
    def first_rank(self) -> bool:
        return self.rank == 0

    @property
    def last_rank(self) -> bool:
        return self.rank == self.size - 1

    def order(self, k: int, forward: bool) -> tuple[int, int]:
        return interleaved_order(k, self.size, self.chunks, forward)

    def send_forward(self, k: int) -> Action | None:
        """Send of the output of forward ``k`` (none from the very last virtual stage)."""
        mb, chunk = self.order(k, True)
        if self.last_rank and chunk == self.chunks - 1:
            return None
        return Action(Kind.SEND_FORWARD, mb, chunk)

    def send_backward(self, k: int) -> Action | None:
        """Send of the input gradient of backward ``k`` (none from the very first stage)."""
        mb, chunk = self.order(k, False)
        if self.first_rank and chunk == 0:
            return None
        return Action(Kind.SEND_BACKWARD, mb, chunk)


def _interleaved_check(s: _Shape) -> None:
    _check_rank(s.rank, s.size)
    _check_positive(num_model_chunks=s.chunks, num_microbatches=s.microbatches)
    if s.size < 2:
        raise ValueError(f"the interleaved schedule needs pp_size >= 2, got pp_size={s.size}; "
                         "use one_f_one_b or no_pipelining instead")
    if s.microbatches % s.size != 0:
        raise ValueError(f"the interleaved schedule needs num_microbatches ({s.microbatches}) "
                         f"to be a multiple of pp_size ({s.size})")


def _interleaved_warmup(s: _Shape, warmup: int, label: _Labeller,
                        recv_first_grad: bool) -> list[Step]:
    """Warm-up forwards; each is followed by sending its output and receiving the next input."""
    steps: list[Step] = []
    if not s.first_rank:
        steps += _exchange(label.recv_forward(0))
    for k in range(warmup):
        steps.append(Action(Kind.FORWARD, *s.order(k, True)))
        next_chunk = s.order(k + 1, True)[1]
        recv_prev = k != s.total - 1 and not (s.first_rank and next_chunk == 0)
        recv_f = label.recv_forward(next_chunk) if recv_prev else None
        recv_b = None
        if k == warmup - 1 and recv_first_grad and not s.last_rank:
            recv_b = label.recv_backward(s.chunks - 1)
        steps += _exchange(s.send_forward(k), recv_f, recv_b)
    return steps


def _interleaved_steady(s: _Shape, warmup: int, label: _Labeller) -> list[Step]:
    """Steady state: one forward and one backward, then one four-way exchange."""
    steps: list[Step] = []
    remaining = s.total - warmup
    for k in range(remaining):
        fwd_k = k + warmup
        steps.append(Action(Kind.FORWARD, *s.order(fwd_k, True)))
        steps.append(Action(Kind.BACKWARD, *s.order(k, False)))
        # Rank 0 gets its input from rank P-1, which runs P-1 forwards behind it;
        # rank P-1 gets its gradient from rank 0, which runs P-1 backwards behind it.
        if s.first_rank:
            chunk = s.order(fwd_k - (s.size - 1), True)[1]
            recv_prev, next_fwd_chunk = chunk != s.chunks - 1, chunk + 1
        else:
            recv_prev, next_fwd_chunk = True, s.order(fwd_k + 1, True)[1]
        if s.last_rank:
            chunk = s.order(k - (s.size - 1), False)[1]
            recv_next, next_bwd_chunk = chunk != 0, chunk - 1
        else:
            recv_next, next_bwd_chunk = True, s.order(k + 1, False)[1]
        recv_prev = recv_prev and k != remaining - 1
        steps += _exchange(s.send_forward(fwd_k),
                           label.recv_forward(next_fwd_chunk) if recv_prev else None,
                           s.send_backward(k),
                           label.recv_backward(next_bwd_chunk) if recv_next else None)
    return steps


def _interleaved_cooldown(s: _Shape, warmup: int, label: _Labeller,
                          all_warmup: bool) -> list[Step]:
    """Cool-down backwards; each sends its input gradient and receives the next gradient."""
    steps: list[Step] = []
    if all_warmup and not s.last_rank:
        steps += _exchange(label.recv_backward(s.chunks - 1))
    for k in range(s.total - warmup, s.total):
        steps.append(Action(Kind.BACKWARD, *s.order(k, False)))
        next_chunk = s.order(k + 1, False)[1]
        recv_next = k != s.total - 1 and not (s.last_rank and next_chunk == s.chunks - 1)
        steps += _exchange(s.send_backward(k),
                           label.recv_backward(next_chunk) if recv_next else None)
    return steps


def interleaved_one_f_one_b(pp_rank: int, pp_size: int, num_model_chunks: int,
                            num_microbatches: int, forward_only: bool = False) -> list[Step]:
    """Megatron's interleaved 1F1B schedule for one rank holding ``num_model_chunks`` chunks.

    Forwards run in the order of :func:`interleaved_order`; warm-up length is
    :func:`interleaved_num_warmup`; each forward/backward is followed by one
    exchange that sends what it produced and receives what the next step on
    that link needs. ``num_microbatches`` must be a multiple of ``pp_size``.
    """
    s = _Shape(pp_rank, pp_size, num_model_chunks, num_microbatches)
    _interleaved_check(s)
    label = _Labeller(num_model_chunks)
    if forward_only:
        return _interleaved_warmup(s, s.total, label, recv_first_grad=False)
    warmup = interleaved_num_warmup(pp_rank, pp_size, num_model_chunks, num_microbatches)
    all_warmup = warmup == s.total
    steps = _interleaved_warmup(s, warmup, label, recv_first_grad=not all_warmup)
    steps += _interleaved_steady(s, warmup, label)
    steps += _interleaved_cooldown(s, warmup, label, all_warmup)
    return steps


def build_schedule(schedule: str, pp_rank: int, pp_size: int, num_model_chunks: int,
                   num_microbatches: int, forward_only: bool = False) -> list[Step]:
    """Dispatch on the schedule name: ``"none"``, ``"1f1b"`` or ``"interleaved"``."""
    if schedule == "none":
        if pp_size != 1 or num_model_chunks != 1:
            raise ValueError(f"schedule 'none' needs pp_size=1 and one model chunk, got "
                             f"pp_size={pp_size}, chunks={num_model_chunks}; use '1f1b'")
        return no_pipelining(num_microbatches, forward_only)
    if schedule == "1f1b":
        if num_model_chunks != 1:
            raise ValueError(f"schedule '1f1b' needs one model chunk, got {num_model_chunks}; "
                             "use 'interleaved'")
        return one_f_one_b(pp_rank, pp_size, num_microbatches, forward_only)
    if schedule == "interleaved":
        return interleaved_one_f_one_b(pp_rank, pp_size, num_model_chunks, num_microbatches,
                                       forward_only)
    raise ValueError(f"unknown pipeline schedule {schedule!r}; use 'none', '1f1b' or 'interleaved'")

