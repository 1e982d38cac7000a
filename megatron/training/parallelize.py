"""How a model becomes this rank's part of the parallel model: the one ordered place.

`build_model` makes this rank's chunks and `parallelize` applies what each still needs, in
this order:

1. pipeline parallelism: this stage's chunks of layers, embedding and loss, as
   megatron/pipeline/layout.py places them (`Config.pipeline_layout()`: the even split,
   --decoder-first/last-pipeline-num-layers or --pipeline-model-parallel-layout;
   `--num-layers-per-virtual-pipeline-stage` or the layout give several chunks per stage);
2. tensor and sequence parallelism: at construction, from `chunk_config` (the model flags
   with `--sequence-parallel`) and the state's TP group, which the spec's layers take;
3. expert parallelism (and expert TP): at construction, from the state's expert groups;
4. initialisation from the global seed, the same full weights on every layout;
5. context parallelism: attention across the CP group (its inputs are this rank's two
   sequence chunks), MoE routers counting their auxiliary losses over whole sequences;
6. activation recomputation: the spec's `--recompute-granularity` / `--recompute-method`,
   read by the layers themselves (a model built in one process recomputes alike);
7. dtype and device;
8. `--torch-compile`: each transformer layer compiled in place;
9. `--use-torch-fsdp2`: last, as torchtitan does: each transformer layer (and an untied
   model's embedding) an FSDP unit, the chunk the root unit, sharded over the DP x CP group,
   each layer's MoE experts a unit over the expert-DP group (megatron/distributed/fsdp.py).
   The parameters are fp32 copies of the compute-dtype ones (the optimizer's main
   parameters); with --bf16 FSDP gathers them in bf16 and reduces gradients in fp32.

Then every rank agrees on the fused kernels' choices for the run's shapes
(megatron/training/kernel_choices.py): a collective, here because every rank builds its model
at this point, before any forward.

The degrees themselves are validated once, by megatron/mpu/topology.py's ParallelDims
(Config.check_layout names the flags).
"""
import dataclasses
from typing import Callable, List

import torch
import torch.distributed as dist

from megatron.config import ModelConfig
from megatron.distributed.fsdp import FSDPGroups, apply_fsdp
from megatron.model.transformer import enable_context_parallel
from megatron.training.kernel_choices import agree_kernel_choices
from megatron.pipeline.p2p import P2PCommunicator


def params_dtype(config) -> torch.dtype:
    if config.training.fp16:
        return torch.float16
    return torch.bfloat16 if config.training.bf16 else torch.float32


def chunk_config(config) -> ModelConfig:
    """The model spec every chunk is built from: the model flags, with sequence parallelism
    as --sequence-parallel says (it changes how the layers' TP collectives split)."""
    return dataclasses.replace(config.model, sequence_parallel=config.parallel.sequence_parallel)


def build_model(config, pstate, device, model_provider: Callable) -> List[torch.nn.Module]:
    """This rank's model chunks, parallelised. `model_provider(cfg=, pre_process=,
    post_process=, layer_offset=, num_layers=)` builds one chunk of the spec `cfg`."""
    cfg, models = chunk_config(config), []
    for chunk in config.pipeline_layout().chunks(pstate.pp_rank):
        model = model_provider(cfg=cfg, pre_process=chunk.embedding, post_process=chunk.loss,
                               layer_offset=chunk.layer_offset, num_layers=chunk.num_layers)
        models.append(parallelize(model, config, pstate, device))
    agree_kernel_choices(config, device)  # every rank, here: megatron/fused/choice.py
    return models


def parallelize(model: torch.nn.Module, config, pstate, device) -> torch.nn.Module:
    """Steps 4 to 9 of the module docstring, on one chunk built with `pstate`'s groups."""
    model.init_weights(config.training.seed)
    enable_context_parallel(model, pstate.cp_group, config.parallel.cp_comm_type)
    compute = params_dtype(config)
    model = model.to(device=device, dtype=compute)
    if config.training.torch_compile:
        compile_layers(model)
    if config.parallel.use_torch_fsdp2:
        fp32_main_params(model)
        groups = FSDPGroups(pstate.dp_cp_group, pstate.edp_group, pstate.dp_size)
        apply_fsdp(model, groups, device, config.parallel.fsdp_reshard_after_forward,
                   param_dtype=None if compute == torch.float32 else compute)
    return model


@torch.no_grad()
def fp32_main_params(model: torch.nn.Module) -> None:
    """FSDP's parameters in fp32 (its sharded parameters are the optimizer's main
    parameters), made from the model's 16-bit ones as MegatronOptimizer makes its fp32 main
    parameters: so a bf16 run starts from the same rounded weights with FSDP as without (the
    unrounded fp32 initialisation made bf16 FSDP's losses drift 2e-5 from the same run
    without FSDP). Buffers keep the compute dtype, as without FSDP."""
    for param in model.parameters():
        param.data = param.data.float()


def compile_layers(model: torch.nn.Module) -> None:
    """--torch-compile: each transformer layer through torch.compile, in place (the
    parameters and their names stay those of the module)."""
    for layer in model.language_model.encoder.layers:
        layer.compile()


def pipeline_communicator(config, pstate, device, num_chunks: int, timers=None):
    """The p2p channel between this stage and its neighbours (a ring with virtual pipeline
    chunks); None with one stage. Activations are [seq / CP (/ TP with SP), micro batch,
    hidden]."""
    if pstate.pp_size == 1:
        return None
    seq = config.model.seq_length // pstate.cp_size
    if config.parallel.sequence_parallel:
        seq //= pstate.tp_size
    shape = (seq, config.training.micro_batch_size, config.model.hidden_size)
    ring = num_chunks > 1
    prev_rank = pstate.pp_ranks[(pstate.pp_rank - 1) % pstate.pp_size] if ring else pstate.prev_rank
    next_rank = pstate.pp_ranks[(pstate.pp_rank + 1) % pstate.pp_size] if ring else pstate.next_rank
    # NCCL creates a group's communicator on its first collective, and batched
    # p2p must not be that first call: settle it with a barrier.
    dist.barrier(group=pstate.pp_group)
    return P2PCommunicator(pstate.pp_group, prev_rank, next_rank, shape, params_dtype(config),
                           device, timers=timers)
