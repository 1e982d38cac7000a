"""Point-to-point communication between neighbouring pipeline stages.

Every call posts all of its sends and receives in one
``torch.distributed.batch_isend_irecv`` and waits for all of them, so two
neighbours that send to each other at the same time never deadlock (works on
gloo and NCCL). Ops are posted in the order of
:func:`megatron.pipeline.schedule.transfer_order` (activations before
gradients), which keeps the messages on one link in order when the previous
and next rank are the same process (two-stage interleaved pipeline).

With NCCL, note ``batch_isend_irecv``'s rule: if it is the first collective on
``group``, every rank of the group must take part; run any collective on the
group (e.g. a barrier) before the first pipeline step.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

Timers = Callable[[str], object]  # timers(name) -> object with start() and stop()


class timed:  # noqa: N801 - used like a function: ``with timed(timers, name):``
    """Context manager timing a block with ``timers(name).start()/.stop()`` if timers is set."""

    def __init__(self, timers: Optional[Timers], name: str):
        self.timer = timers(name) if timers is not None else None

    def __enter__(self):
        if self.timer is not None:
            self.timer.start()

    def __exit__(self, *exc):
        if self.timer is not None:
            self.timer.stop()


def exchange_name(send_next: bool, send_prev: bool, recv_prev: bool, recv_next: bool) -> str:
    """Megatron's timer name for a combination of transfers, e.g. ``forward-send-backward-recv``."""
    sends = [d for d, on in (("forward", send_next), ("backward", send_prev)) if on]
    recvs = [d for d, on in (("forward", recv_prev), ("backward", recv_next)) if on]
    parts = []
    if sends:
        parts.append("-".join(sends) + "-send")
    if recvs:
        parts.append("-".join(recvs) + "-recv")
    return "-".join(parts)


class P2PCommunicator:
    """Sends activations to the next stage and gradients to the previous stage.

    Args:
        group: process group holding both neighbours (None: the default group).
        prev_rank / next_rank: global ranks of the neighbours; None at the ends
            of a line. For the interleaved schedule pass the ring neighbours
            (rank 0's previous is the last rank).
        tensor_shape: shape of every tensor moved, e.g. (seq, micro batch, hidden).
        dtype / device: of the moved tensors (CPU with gloo, CUDA with NCCL).
        timers: optional ``timers(name)`` returning an object with start()/stop();
            each call is timed (posting plus waiting) under Megatron's names.
    """

    def __init__(self, group, prev_rank: Optional[int], next_rank: Optional[int],
                 tensor_shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device | str, timers: Optional[Timers] = None):
        self.group = group
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.tensor_shape = tuple(int(d) for d in tensor_shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self.timers = timers

    # -- the one primitive -------------------------------------------------

    def exchange(self, send_next: Optional[torch.Tensor] = None,
                 send_prev: Optional[torch.Tensor] = None, recv_prev: bool = False,
                 recv_next: bool = False) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Post the given sends and receives together, wait for all, return (from_prev, from_next).

        The tensor received from the previous stage is an activation that will
        be back-propagated through, so it comes back with ``requires_grad=True``.
        """
        name = exchange_name(send_next is not None, send_prev is not None, recv_prev, recv_next)
        if not name:
            return None, None
        from_prev = self._buffer() if recv_prev else None
        from_next = self._buffer() if recv_next else None
        ops = []  # order: send_next, recv_prev, send_prev, recv_next (see module docstring)
        if send_next is not None:
            ops.append(self._op(dist.isend, self._checked(send_next, "next"), self.next_rank, "next"))
        if from_prev is not None:
            ops.append(self._op(dist.irecv, from_prev, self.prev_rank, "previous"))
        if send_prev is not None:
            ops.append(self._op(dist.isend, self._checked(send_prev, "previous"), self.prev_rank,
                                "previous"))
        if from_next is not None:
            ops.append(self._op(dist.irecv, from_next, self.next_rank, "next"))
        with timed(self.timers, name):
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        if from_prev is not None:
            from_prev.requires_grad_(True)
        return from_prev, from_next

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)

    def _op(self, fn, tensor: torch.Tensor, peer: Optional[int], side: str) -> dist.P2POp:
        if peer is None:
            raise ValueError(f"cannot communicate with the {side} stage: this stage has no "
                             f"{side} rank (pass {side.replace('previous', 'prev')}_rank)")
        return dist.P2POp(fn, tensor, peer, self.group)

    def _checked(self, tensor: torch.Tensor, side: str) -> torch.Tensor:
        if tuple(tensor.shape) != self.tensor_shape or tensor.dtype != self.dtype:
            raise ValueError(
                f"sending a {tuple(tensor.shape)} {tensor.dtype} tensor to the {side} stage, but "
                f"this communicator moves {self.tensor_shape} {self.dtype} tensors; pass the "
                "matching tensor_shape/dtype when building it")
        return tensor.detach().contiguous()

    # -- named shortcuts (Megatron's vocabulary) ----------------------------

    def recv_forward(self) -> torch.Tensor:
        """Receive an activation from the previous stage."""
        return self.exchange(recv_prev=True)[0]

    def recv_backward(self) -> torch.Tensor:
        """Receive an output gradient from the next stage."""
        return self.exchange(recv_next=True)[1]

    def send_forward(self, output: torch.Tensor) -> None:
        """Send an activation to the next stage."""
        self.exchange(send_next=output)

    def send_backward(self, input_grad: torch.Tensor) -> None:
        """Send an input gradient to the previous stage."""
        self.exchange(send_prev=input_grad)

    def send_forward_recv_backward(self, output: torch.Tensor) -> torch.Tensor:
        """Send an activation forward while receiving a gradient from the next stage."""
        return self.exchange(send_next=output, recv_next=True)[1]

    def send_backward_recv_forward(self, input_grad: torch.Tensor) -> torch.Tensor:
        """Send a gradient backward while receiving an activation from the previous stage."""
        return self.exchange(send_prev=input_grad, recv_prev=True)[0]

    def send_forward_recv_forward(self, output: Optional[torch.Tensor],
                                  recv_prev: bool) -> Optional[torch.Tensor]:
        """Send an activation (if any) forward, optionally receive one from the previous stage."""
        return self.exchange(send_next=output, recv_prev=recv_prev)[0]

    def send_backward_recv_backward(self, input_grad: Optional[torch.Tensor],
                                    recv_next: bool) -> Optional[torch.Tensor]:
        """Send a gradient (if any) backward, optionally receive one from the next stage."""
        return self.exchange(send_prev=input_grad, recv_next=recv_next)[1]
