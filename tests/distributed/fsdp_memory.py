"""What a rank really holds in parameters, gradients and optimizer state, with or without
--use-torch-fsdp2, and the peak of its training steps: the measurement that
tests/distributed/test_fsdp_memory.py and benchmarks/bench_fsdp_memory.py hold the planner
(megatron/training/memory.py) against.

Bytes are those of the unique storages: under FSDP the local shards of the DTensor
parameters (FSDP's padded shard buffers), of their sharded gradients and of Adam's moments;
without it the parameters, our reducer's gradient buffers and the optimizer's tensors."""
import ctypes
import gc
import os
from functools import partial

import torch
from torch._C._profiler import _ExtraFields_Allocation

import pretrain_gpt
from megatron.mpu import model_parallel_seed
from megatron.mpu.fsdp_shards import local
from megatron.training.parallelize import build_model
from megatron.training.trainer import Trainer


def _storages(tensors) -> dict:
    held = {}
    for t in tensors:
        storage = local(t).untyped_storage()
        held[storage.data_ptr()] = storage.nbytes()
    return held


def _gradients(trainer, params) -> dict:
    if trainer.fsdp:  # FSDP's sharded .grad (kept to the next zero_grad)
        return _storages(p.grad for p in params if p.grad is not None)
    return _storages(r.buffer for r in trainer.reducers)


def state_bytes(trainer) -> dict:
    """{parameters, gradients, optimizer}: bytes of the storages the rank holds for each."""
    params = [p for m in trainer.models for p in m.parameters()]
    held_params = _storages(params)
    grads = _gradients(trainer, params)
    opt = trainer.optimizer
    held = [t for st in opt.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
    held += [p for g in opt.optimizer.param_groups for p in g["params"]]
    if getattr(opt, "flat", None) is not None and opt.flat.flat_grads is not None:
        held.append(opt.flat.flat_grads)
    optimizer = {k: v for k, v in _storages(held).items()
                 if k not in held_params and k not in grads}
    return {"parameters": sum(held_params.values()), "gradients": sum(grads.values()),
            "optimizer": sum(optimizer.values())}


def count_frees_on_every_thread() -> None:
    """Have the CPU allocator account for frees on every thread, not only on those the profiler
    watches. A tensor handed to a gloo collective can lose its last reference on gloo's worker
    thread (when the work object outlives the caller's reference); the profiler records no
    event for that free, so its bytes would stay live for the rest of the stretch, a different
    amount in every run: test_moe_estimate's TP 2 peaks read 15.1 to 17.8 MB without this,
    14.96 to 15.08 MB with it. With c10's flag caffe2_report_cpu_memory_usage on, the
    allocator's running total, which every event carries, counts those frees too. Blocks
    allocated before the call are not counted."""
    library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(library, "FLAGS_caffe2_report_cpu_memory_usage").value = True


def peak_live_bytes(prof) -> int:
    """The most bytes live at once in a profiled stretch, above what was live at its start: the
    largest of the CPU allocator's running totals that torch.profiler's allocation events carry
    (exact whatever thread frees a block once `count_frees_on_every_thread` has run)."""
    allocations = []
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if isinstance(event.extra_fields, _ExtraFields_Allocation):
            allocations.append((event.start_time_ns, event.extra_fields))
    if not allocations:
        return 0
    allocations.sort(key=lambda pair: pair[0])
    first = allocations[0][1]
    start = first.total_allocated - first.alloc_size
    return max(fields.total_allocated for _, fields in allocations) - start


def build_trainer(config, pstate, vocab: int):
    """pretrain_gpt.py's model, forward step and Trainer on the CPU."""
    model_parallel_seed(1234, pstate.tp_rank)
    device = torch.device("cpu")
    provider = partial(pretrain_gpt.model_provider, config, pstate.tp_group,
                       expert_groups=pstate.expert_groups())
    models = build_model(config, pstate, device, provider)
    return Trainer(config, pstate, device, models,
                   partial(pretrain_gpt.forward_step, config, vocab - 1, pstate, device))


def measure(config, pstate, vocab: int, steps: int = 2, peak: bool = False) -> dict:
    """State bytes after `steps` training steps (the optimizer's state exists from the first
    on); with `peak`, also the most the rank held at once over the steps ("peak": what it
    held before them plus the most they allocated on top, torch.profiler's events)."""
    from torch.profiler import ProfilerActivity, profile
    count_frees_on_every_thread()
    trainer = build_trainer(config, pstate, vocab)
    gc.collect()
    t = config.training
    micro = t.global_batch_size // (t.micro_batch_size * pstate.dp_size)
    generator = torch.Generator().manual_seed(pstate.dp_rank)
    s, b = config.model.seq_length, t.micro_batch_size

    def batches():
        return [iter([{"text": torch.randint(0, vocab - 1, (b, s + 1), generator=generator)}
                      for _ in range(micro)])]
    before = sum(state_bytes(trainer).values())
    if not peak:
        for _ in range(steps):
            trainer.train_step(batches())
        return state_bytes(trainer)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(steps):
            trainer.train_step(batches())
    return {**state_bytes(trainer), "peak": before + peak_live_bytes(prof)}
