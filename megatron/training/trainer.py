"""One training step and one evaluation over a global batch, driven by a pipeline schedule.

The `Trainer` owns this rank's model chunks, their gradient reducers, the
optimizer, the lr schedule and the micro-batch count; `pretrain.py` runs the loop.
"""
import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import Dict, List

import torch
import torch.distributed as dist

from megatron.distributed.ddp import build_grad_reducers
from megatron.distributed.fsdp import FSDPReducer
from megatron.distributed.grads import (allreduce_embedding_grads,
                                        allreduce_sequence_parallel_grads, tied_embedding_params)
from megatron.model.moe.layer import collect_moe_metrics, update_expert_bias
from megatron.model.moe.router import AuxLossScaler
from megatron.model.mtp import collect_mtp_metrics
from megatron.mpu.mappings import COLLECTIVE_WAIT
from megatron.optimizer import build_lr_scheduler, build_optimizer
from megatron.pipeline.executor import forward_backward
from megatron.training.logging import TensorBoard, Timers
from megatron.training.microbatches import MicroBatches
from megatron.training.parallelize import params_dtype, pipeline_communicator
from megatron.training.straggler import COMPUTE_TIMERS, StragglerDetector, describe_hosts


def is_last_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def print_rank_0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def print_rank_last(message: str) -> None:
    if is_last_rank():
        print(message, flush=True)


class ReplayIterators:
    """One iterator per model chunk over the same micro batches: the first chunk
    to ask for the k-th micro batch pulls it from the loader, the others replay it."""

    def __init__(self, iterator, num_chunks: int):
        self.iterator = iterator
        self.queues = [deque() for _ in range(num_chunks)]

    def chunk(self, index: int):
        while True:
            if not self.queues[index]:
                item = next(self.iterator)
                for q in self.queues:
                    q.append(item)
            yield self.queues[index].popleft()

    def all(self):
        return [self.chunk(i) for i in range(len(self.queues))]


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train: int = 0
    consumed_valid: int = 0
    history: List[Dict[str, float]] = field(default_factory=list)
    validation: List[Dict[str, float]] = field(default_factory=list)


class Trainer:
    def __init__(self, config, pstate, device, models, forward_step):
        self.config, self.pstate, self.device = config, pstate, device
        self.models = models
        grad_dtype = torch.float32 if (config.training.fp16 or config.training.bf16
                                       or config.parallel.accumulate_allreduce_grads_in_fp32) \
            else params_dtype(config)
        self.fsdp = config.parallel.use_torch_fsdp2
        # Under FSDP our reducer is bypassed: FSDP reduce-scatters the gradients itself.
        keep = not config.parallel.fsdp_reshard_after_forward
        self.reducers = ([FSDPReducer(m, keep) for m in models] if self.fsdp else build_grad_reducers(
            models, pstate, config.parallel, grad_dtype, tied_embedding_params(models, pstate)))
        self.torch_ddp = config.parallel.DDP_impl == "torch"
        # --DDP-impl torch: the forward goes through the DDP wrapper (the plain
        # module stays in self.models for checkpoints and set_input_tensor).
        self.forward_step = self._ddp_forward_step if self.torch_ddp else forward_step
        self._user_forward_step = forward_step
        self.optimizer = build_optimizer(config, models, pstate, self.reducers)
        self.scheduler = build_lr_scheduler(self.optimizer, config.optimizer, config.training)
        self.microbatches = MicroBatches.of(config, pstate.dp_size)
        straggler = config.logging.log_straggler
        self.timers = Timers(config.logging.timing_log_level,
                             always=COMPUTE_TIMERS if straggler else (),
                             wait_clock=COLLECTIVE_WAIT if straggler else None)
        self.stragglers = StragglerDetector(config.logging.straggler_minmax_count) \
            if straggler else None
        if straggler:
            print_rank_0(describe_hosts(self.stragglers.hosts))
        self.comm = pipeline_communicator(config, pstate, device, len(models), self.timers)
        self.schedule = ("none" if pstate.pp_size == 1
                         else "interleaved" if len(models) > 1 else "1f1b")
        self.tensorboard = TensorBoard(config.logging.tensorboard_dir if is_last_rank() else None,
                                       config.logging.tensorboard_queue_size)
        self.state = TrainState()

    def _ddp_forward_step(self, data_iterator, model):
        reducer = self.reducers[self.models.index(model)]
        return self._user_forward_step(data_iterator, reducer.module_for_forward())

    @contextlib.contextmanager
    def _no_sync(self):
        with contextlib.ExitStack() as stack:
            for reducer in self.reducers:
                stack.enter_context(reducer.no_sync())
            yield

    def _run_schedule(self, iterators, num_microbatches, forward_only):
        scale = self.optimizer.loss_scale
        # MoE auxiliary and MTP losses get the main loss's gradient scale (Megatron-LM's).
        AuxLossScaler.set_scale((1.0 if scale is None else float(scale)) / num_microbatches)
        return forward_backward(
            self.schedule, forward_step=self.forward_step, data_iterators=iterators,
            model_chunks=self.models, num_microbatches=num_microbatches, comm=self.comm,
            pp_rank=self.pstate.pp_rank, pp_size=self.pstate.pp_size, forward_only=forward_only,
            no_sync=self._no_sync, timers=self.timers,
            loss_scale=None if scale is None else scale.to(self.device))

    def train_step(self, iterators):
        """One optimizer step over a global batch; returns (losses, grad_norm, skipped, nan)."""
        num_micro_batches = self.microbatches.num_micro_batches
        for reducer in self.reducers:
            reducer.zero_grad()
            if self.torch_ddp:
                reducer.begin_step(num_micro_batches)
        losses = self._run_schedule(iterators, num_micro_batches, False)
        moe_metrics = collect_moe_metrics(self.models, self.pstate, num_micro_batches)
        moe_metrics.update(collect_mtp_metrics(self.models, self.pstate, num_micro_batches))
        self._reduce_grads()
        # Megatron-Core's finalize_model_grads: every step, before the optimizer may skip
        update_expert_bias(self.models, self.pstate)
        self.timers.start("optimizer")
        applied, grad_norm, overflow = self.optimizer.step()  # applied == not overflow
        self.timers.stop("optimizer")
        if applied:
            self.scheduler.step(self.microbatches.global_batch_size)
        losses = average_losses(losses)
        if losses:  # the last stage reports them, with the MoE fields
            losses.update(moe_metrics)
        # Non-finite gradients: with fp16 loss scaling an expected overflow (a skipped
        # step), otherwise a nan iteration.
        scaled = self.optimizer.grad_scaler is not None
        return losses, grad_norm, overflow and scaled, overflow and not scaled

    def _reduce_grads(self) -> None:
        """Average gradients over DP (summing the CP ranks' parts), sum the tied embedding
        copies and the sequence-parallel partial gradients."""
        # The distributed optimizer's reduce-scatter leaves each DP rank only its
        # shard, at different offsets on the first and last stage: sum the
        # embedding copies before it (their buckets are held back from an
        # overlapped reduction until finish_grad_sync).
        embedding_first = self.config.parallel.use_distributed_optimizer
        if embedding_first:
            self._reduce_embedding_grads()
        self.timers.start("grads-all-reduce")
        for reducer in self.reducers:
            reducer.finish_grad_sync()  # dense over DP x CP, experts over expert-DP
        self.timers.stop("grads-all-reduce")
        if self.config.parallel.sequence_parallel:
            allreduce_sequence_parallel_grads(self.models, self.pstate.tp_group)
        if not embedding_first:
            self._reduce_embedding_grads()

    def _reduce_embedding_grads(self) -> None:
        self.timers.start("embedding-grads-all-reduce")
        allreduce_embedding_grads(self.models, self.pstate)
        self.timers.stop("embedding-grads-all-reduce")

    @torch.no_grad()
    def evaluate(self, iterators, num_iters: int, verbose: bool = False) -> Dict[str, float]:
        """Mean losses over `num_iters` global batches; `verbose` prints Megatron's
        "Evaluating iter i/n" progress every --log-interval iterations."""
        for m in self.models:
            m.eval()
        totals: Dict[str, float] = {}
        micro = self.config.training.global_batch_size // (
            self.config.training.micro_batch_size * self.pstate.dp_size)
        for i in range(num_iters):
            for key, value in average_losses(self._run_schedule(iterators, micro, True)).items():
                totals[key] = totals.get(key, 0.0) + value / num_iters
            self.state.consumed_valid += self.config.training.global_batch_size
            if verbose and (i + 1) % self.config.logging.log_interval == 0:
                print_rank_0(f" Evaluating iter {i + 1}/{num_iters}")
        for m in self.models:
            m.train()
        return totals


def average_losses(losses: List[dict]) -> Dict[str, float]:
    """Mean over micro batches of each reported loss (present on the last stage only)."""
    if not losses:
        return {}
    return {key: sum(float(d[key]) for d in losses) / len(losses) for key in losses[0]}


def total_iterations(config) -> int:
    t = config.training
    if t.train_iters is not None:
        return t.train_iters
    if t.rampup_batch_size is None and t.step_batch_size_schedule is None:
        return t.train_samples // t.global_batch_size
    mb = MicroBatches.of(config, 1)
    consumed, iters = 0, 0
    while consumed < t.train_samples:
        mb.update(consumed)
        consumed += mb.global_batch_size
        iters += 1
    return iters
