"""Run a pipeline schedule: forwards, backwards and p2p transfers for one global batch.

The order of work comes from :mod:`megatron.pipeline.schedule` (pure data);
this module only carries it out, keeping the tensors of each in-flight
(micro-batch, chunk) between its forward and its backward.

Memory: once a stage's output activation has been sent to the next stage, only
its autograd graph is needed, so its storage is swapped for a one-element
tensor and the backward later runs through the autograd engine directly (which
does not compare the gradient's shape with the freed output's). Views are left
alone (freeing them would not release their base).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Sequence

import torch

from megatron.pipeline.p2p import P2PCommunicator, Timers, timed
from megatron.pipeline.schedule import Action, Exchange, Kind, build_schedule

Key = tuple[int, int]  # (micro-batch, chunk)


def free_output_storage(tensor: Optional[torch.Tensor]) -> None:
    """Replace the storage of a sent activation with one element; its graph stays usable."""
    if tensor is None or tensor._base is not None:
        return
    tensor.data = torch.empty((1,), device=tensor.device, dtype=tensor.dtype)


def backward_unchecked(output: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
    """``torch.autograd.backward(output, grad)`` without the check that shapes agree."""
    if grad is None:
        torch.autograd.backward(output)
        return
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad,), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True)


class _Runner:
    """Carries out one rank's schedule; holds the tensors of in-flight micro-batches."""

    def __init__(self, *, forward_step, data_iterators, model_chunks, num_microbatches,
                 comm, pp_rank, pp_size, forward_only, no_sync, loss_scale, timers):
        self.forward_step = forward_step
        self.data_iterators = data_iterators
        self.model_chunks = model_chunks
        self.num_microbatches = num_microbatches
        self.comm = comm
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.forward_only = forward_only
        self.no_sync = no_sync
        self.loss_scale = loss_scale
        self.timers = timers
        self.inputs: dict[Key, torch.Tensor] = {}
        self.outputs: dict[Key, torch.Tensor] = {}
        self.output_grads: dict[Key, torch.Tensor] = {}
        self.input_grads: dict[Key, torch.Tensor] = {}
        self.losses: list[dict] = []

    def is_first(self, chunk: int) -> bool:
        return self.pp_rank == 0 and chunk == 0

    def is_last(self, chunk: int) -> bool:
        return self.pp_rank == self.pp_size - 1 and chunk == len(self.model_chunks) - 1

    def run(self, step) -> None:
        if isinstance(step, Exchange):
            self.exchange(step)
        elif step.kind == Kind.FORWARD:
            self.forward(step.microbatch, step.chunk)
        else:
            self.backward(step.microbatch, step.chunk)

    def forward(self, mb: int, chunk: int) -> None:
        key = (mb, chunk)
        model = self.model_chunks[chunk]
        if not self.is_first(chunk):
            model.set_input_tensor(self.inputs[key])
            if self.forward_only:
                del self.inputs[key]
        with timed(self.timers, "forward-compute"):
            output, loss_func = self.forward_step(self.data_iterators[chunk], model)
            if self.is_last(chunk):
                loss, reduced = loss_func(output)
                self.losses.append(reduced)
                output = loss / self.num_microbatches
        if not self.forward_only or not self.is_last(chunk):
            self.outputs[key] = output

    def backward(self, mb: int, chunk: int) -> None:
        key = (mb, chunk)
        output = self.outputs.pop(key)
        grad = self.output_grads.pop(key, None)
        inp = self.inputs.pop(key, None)
        if self.is_last(chunk) and self.loss_scale is not None:
            output = output * self.loss_scale
        sync = mb == self.num_microbatches - 1
        with (contextlib.nullcontext() if sync else self.no_sync()):
            with timed(self.timers, "backward-compute"):
                backward_unchecked(output, grad)
        if inp is not None:
            if inp.grad is None:
                raise RuntimeError(f"model chunk {chunk} produced no gradient for its input "
                                   f"tensor (micro-batch {mb}); its output must depend on the "
                                   "tensor given to set_input_tensor")
            self.input_grads[key] = inp.grad

    def exchange(self, step: Exchange) -> None:
        send_f, send_b = step.find(Kind.SEND_FORWARD), step.find(Kind.SEND_BACKWARD)
        recv_f, recv_b = step.find(Kind.RECV_FORWARD), step.find(Kind.RECV_BACKWARD)
        out = self._sent_output(send_f)
        from_prev, from_next = self.comm.exchange(
            send_next=out,
            send_prev=self.input_grads.pop(_key(send_b)) if send_b else None,
            recv_prev=recv_f is not None, recv_next=recv_b is not None)
        if out is not None and not self.forward_only:
            free_output_storage(self.outputs[_key(send_f)])
        if recv_f is not None:
            self.inputs[_key(recv_f)] = from_prev
        if recv_b is not None:
            self.output_grads[_key(recv_b)] = from_next

    def _sent_output(self, send_f: Optional[Action]) -> Optional[torch.Tensor]:
        if send_f is None:
            return None
        if self.forward_only:
            return self.outputs.pop(_key(send_f))
        return self.outputs[_key(send_f)]


def _key(action: Action) -> Key:
    return action.microbatch, action.chunk


def _validate(data_iterators, model_chunks, num_microbatches, comm, pp_rank, pp_size):
    if not model_chunks:
        raise ValueError("model_chunks is empty; pass a list with one module per model chunk")
    if len(data_iterators) != len(model_chunks):
        raise ValueError(f"got {len(data_iterators)} data iterators for {len(model_chunks)} model "
                         "chunks; pass one per chunk (None where a chunk reads no data)")
    if pp_size > 1 and comm is None:
        raise ValueError(f"pp_size={pp_size} needs a P2PCommunicator (comm=None given)")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")


def forward_backward(schedule: str, *, forward_step: Callable[[Any, torch.nn.Module], tuple],
                     data_iterators: Sequence[Any], model_chunks: Sequence[torch.nn.Module],
                     num_microbatches: int, comm: Optional[P2PCommunicator], pp_rank: int,
                     pp_size: int, forward_only: bool = False,
                     no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                     loss_scale: Optional[torch.Tensor] = None,
                     timers: Optional[Timers] = None) -> list[dict]:
    """Run forward (and backward) over ``num_microbatches`` micro-batches with a pipeline schedule.

    Args:
        schedule: ``"none"`` (one stage), ``"1f1b"`` or ``"interleaved"``.
        forward_step: ``forward_step(data_iterator, model_chunk) -> (output, loss_func)``; on
            the last stage ``loss_func(output) -> (loss, {"lm loss": detached, ...})``.
        data_iterators / model_chunks: one per model chunk held by this rank. Chunks of
            non-first stages get their input through ``set_input_tensor(tensor)``.
        comm: the communicator to the neighbouring stages (None when ``pp_size == 1``).
        forward_only: run the forwards only (evaluation), still pipelined.
        no_sync: context-manager factory wrapped around every backward except the one of
            the last micro-batch of each chunk (defer the data-parallel gradient reduction).
        loss_scale: multiplies the loss (already divided by ``num_microbatches``) for backward.
        timers: optional ``timers(name)`` with start()/stop(): compute and p2p times.

    Returns:
        The loss dicts of every micro-batch on the last stage, ``[]`` on other stages.
    """
    _validate(data_iterators, model_chunks, num_microbatches, comm, pp_rank, pp_size)
    steps = build_schedule(schedule, pp_rank, pp_size, len(model_chunks), num_microbatches,
                           forward_only)
    runner = _Runner(forward_step=forward_step, data_iterators=data_iterators,
                     model_chunks=model_chunks, num_microbatches=num_microbatches, comm=comm,
                     pp_rank=pp_rank, pp_size=pp_size, forward_only=forward_only,
                     no_sync=no_sync, loss_scale=loss_scale, timers=timers)
    for step in steps:
        runner.run(step)
    return runner.losses
