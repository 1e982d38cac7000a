"""tools/estimate.py's MoE memory plan against a real training step, within 10%, at EP 1
(one process), EP 2 (two ranks, each dispatcher) and expert TP 1 under TP 2: parameters, gradient buffers and
optimizer state of the rank (expert parameters divided by EP), what autograd saves in one
forward (router, dispatched token copies, expert activations, shared expert), and the
peak of a whole training step: what is held before it plus the most the step allocates
on top (torch.profiler's allocator events), against the planner's total."""
import gc
from functools import partial

import pytest
import torch

import pretrain_gpt
from megatron.mpu import model_parallel_seed, single_process_state
from megatron.training.memory import Layout, estimate
from megatron.training.parallelize import build_model
from megatron.training.trainer import Trainer
from tests.distributed.fsdp_memory import count_frees_on_every_thread, peak_live_bytes
from tests.distributed.run_ranks import run_ranks
from tests.gpt_setup import one_thread
from tests.unit.test_estimate import VOCAB, _close, _storages, config_for, saved_activation_bytes

MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "96",
       "--moe-layer-freq", "2", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3",
       "--moe-shared-expert-intermediate-size", "64", "--swiglu", "--disable-bias-linear",
       "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "128",
       "--normalization", "RMSNorm", "--position-embedding-type", "rope",
       "--micro-batch-size", "4", "--seq-length", "128", "--max-position-embeddings", "128"]


def measured(config, pstate):
    """Bytes of the rank's state after a training step, what one forward saves, and the
    peak of all the bytes the rank holds, from building the model through two steps."""
    from torch.profiler import ProfilerActivity, profile
    count_frees_on_every_thread()
    gc.collect()  # the previous run's model and trainer, if any, are gone before the window
    model_parallel_seed(1234, pstate.tp_rank)
    s, b = config.model.seq_length, config.training.micro_batch_size
    generator = torch.Generator().manual_seed(pstate.dp_rank)
    text = [torch.randint(0, VOCAB - 1, (b, s + 1), generator=generator) for _ in range(2)]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        provider = partial(pretrain_gpt.model_provider, config, pstate.tp_group,
                           expert_groups=pstate.expert_groups())
        models = build_model(config, pstate, torch.device("cpu"), provider)
        trainer = Trainer(config, pstate, torch.device("cpu"), models,
                          partial(pretrain_gpt.forward_step, config, VOCAB - 1, pstate,
                                  torch.device("cpu")))
        for tokens in text:  # the optimizer's state exists from the first step on
            trainer.train_step([iter([{"text": tokens}])])
    params = _storages(p for m in models for p in m.parameters())
    grads = _storages(r.buffer for r in trainer.reducers)
    opt = trainer.optimizer
    held = [t for st in opt.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
    held += [p for g in opt.optimizer.param_groups for p in g["params"]]
    if getattr(opt, "flat", None) is not None and opt.flat.flat_grads is not None:
        held.append(opt.flat.flat_grads)
    optimizer = {k: v for k, v in _storages(held).items() if k not in params and k not in grads}
    acts = saved_activation_bytes(models[0], b, s, config.model.hidden_size)
    return {"parameters": sum(params.values()), "gradients": sum(grads.values()),
            "optimizer": sum(optimizer.values()), "activations": acts,
            "peak": peak_live_bytes(prof)}


def _compare(config, world_size, result, what):
    predicted = estimate(config, Layout(world_size=world_size, device_type="cpu"))
    for key in ("parameters", "gradients", "optimizer"):
        _close(predicted[key], result[key], f"{what} {key}")
    _close(predicted["activations_per_micro_batch"], result["activations"], f"{what} activations")
    _close(predicted["total"], result["peak"], f"{what} training peak")


def test_moe_memory_one_process():
    config = config_for(*MOE)
    with one_thread():
        _compare(config, 1, measured(config, single_process_state()), "EP 1")


def _two_ranks(rank, world_size, flags, tp, ep, etp):
    from megatron.mpu import initialize_model_parallel
    config = config_for(*MOE, *flags, world_size=2)
    return measured(config, initialize_model_parallel(tp, 1, ep=ep, etp=etp))


def _compare_two_ranks(flags, tp=1, ep=2, etp=None):
    results = run_ranks(_two_ranks, 2, flags, tp, ep, etp)
    config = config_for(*MOE, *flags, world_size=2)
    for rank, result in enumerate(results):
        _compare(config, 2, result, f"{' '.join(flags)} rank {rank}")


@pytest.mark.parametrize("dispatcher, extra", [("alltoall", ()), ("allgather", ()),
                                               ("alltoall", ("--use-distributed-optimizer",))])
def test_moe_memory_at_ep2(dispatcher, extra):
    _compare_two_ranks(["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                        dispatcher, *extra])


@pytest.mark.parametrize("ep, extra", [(1, ()), (2, ()), (1, ("--use-distributed-optimizer",))])
def test_moe_memory_at_tp2_etp1(ep, extra):
    """Experts whole on each rank (ETP 1 under TP 2): expert parameters and rows not split
    by TP, the routed rows cut in two."""
    _compare_two_ranks(["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
                        "--expert-model-parallel-size", str(ep), "--moe-token-dispatcher-type",
                        "alltoall", *extra], tp=2, ep=ep, etp=1)
