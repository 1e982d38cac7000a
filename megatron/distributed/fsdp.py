"""--use-torch-fsdp2: parameters, gradients and optimizer state sharded over data parallelism
by torch's FSDP2 (`torch.distributed.fsdp.fully_shard`).

Each transformer layer is an FSDP unit, and so is the input embedding of an untied model;
the root unit (the whole chunk) holds the rest: the final norm and the output layer, and the
word embeddings of a tied model (used twice in one forward, by the embedding and the head,
they must live in one unit). The units shard over the data-parallel x context-parallel
group (Megatron-Core's FSDP mesh; DP alone without CP): every parameter becomes a DTensor
split along dim 0 over it (after TP has split it, so TP sits inside a 2-D layout). The MoE
experts of each layer are a unit of their own, sharded over the expert-data-parallel group
(the ranks holding the same experts) instead. Gradients are reduce-scattered by FSDP, summed
over the unit's group and divided by the DP size (as our reducer does: a CP rank's gradient
is its part of the sequence's; an expert's already sums its EP ranks' tokens), in fp32
(`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` with --bf16: the sharded
parameters themselves stay fp32 and serve as the optimizer's main parameters).

`FSDPReducer` stands in for our gradient reducer: gradients are reduce-scattered once per
global batch, at the backward of each chunk's last micro batch; the pipeline schedules wrap
the other backwards in `no_sync`, where FSDP accumulates the unsharded gradients (in fp32,
the reduce dtype) without communicating.

`local_shards` gives each parameter's (or gradient's) local shard and where it starts in
the flattened TP-local tensor: what the norms (clipping, --log-params-norm, zeros) count,
summed once over the group each shard belongs to (shard_groups), each shard exactly once.
"""
import contextlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from megatron.mpu.fsdp_shards import local, shard_start
from megatron.mpu.mappings import group_size


def local_shards(params, grads) -> Tuple[List, List, List[int]]:
    """(params, local gradient shards, starts) for norm_and_nonfinite / norm_parts."""
    return (list(params), [local(g) for g in grads],
            [shard_start(g) if g is not None else 0 for g in grads])


def shard_groups(pstate) -> dict:
    """The groups norm_and_nonfinite sums FSDP's local shards over: dense ones over DP x
    CP, the experts' over expert-DP (as apply_fsdp shards them)."""
    return {"dp_group": pstate.dp_cp_group, "edp_group": pstate.edp_group}


def _custom_attributes(module: torch.nn.Module) -> Dict[str, dict]:
    return {name: dict(vars(p)) for name, p in module.named_parameters()}


def _restore_attributes(module: torch.nn.Module, saved: Dict[str, dict]) -> None:
    """FSDP replaces every parameter by a new one (a DTensor), which loses the attributes
    our TP layers, sharding metadata and norms read (tensor_model_parallel, sharding, ...)."""
    for name, p in module.named_parameters():
        for key, value in saved.get(name, {}).items():
            setattr(p, key, value)


def fsdp_units(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The sub-modules that become their own FSDP units, in forward order (the root is
    sharded after them)."""
    lm = model.language_model
    units = []
    if lm.embedding is not None and model.cfg.untie_embeddings_and_output_weights:
        units.append(lm.embedding)
    units.extend(lm.encoder.layers)
    return units


def expert_units(layer: torch.nn.Module) -> List[torch.nn.Module]:
    """The outermost sub-modules of `layer` whose parameters are all MoE experts'
    (`expert_parallel`): the units sharded over the expert-data-parallel group."""
    units: List[Tuple[str, torch.nn.Module]] = []
    for name, module in layer.named_modules():
        params = list(module.parameters())
        inside = any(name.startswith(prefix + ".") for prefix, _ in units)
        if params and not inside and all(getattr(p, "expert_parallel", False) for p in params):
            units.append((name, module))
    return [module for _, module in units]


@dataclass(frozen=True)
class FSDPGroups:
    """The groups FSDP shards over: `dense` (DP x CP), `experts` (expert-DP), and the DP
    size every gradient is divided by."""
    dense: object
    experts: object
    dp_size: int


def _shard(module, group, dp_size: int, device, **options) -> None:
    """fully_shard over `group`; gradients summed over it and divided by `dp_size` (FSDP's
    own average when that is the group's size)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    fully_shard(module, mesh=DeviceMesh.from_group(group, device.type), **options)
    size = group_size(group)
    if size != dp_size:
        module.set_gradient_divide_factor(float(dp_size))
        # gloo has no PREMUL_SUM: sum, then divide. Not on a group of one rank, where torch
        # 2.13 (no collective to run) would divide twice (by the factor, then after "the sum").
        module.set_force_sum_reduction_for_comms(size > 1)


def apply_fsdp(model: torch.nn.Module, groups: FSDPGroups, device: torch.device,
               reshard_after_forward: bool = True,
               param_dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
    """Shard `model` (fp32 parameters on `device`) with FSDP2, in place: experts over
    `groups.experts`, the rest over `groups.dense`; `param_dtype` (bf16): the dtype the
    gathered parameters compute in, gradients reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    policy = MixedPrecisionPolicy(param_dtype=param_dtype,
                                  reduce_dtype=torch.float32 if param_dtype else None)
    options = dict(reshard_after_forward=reshard_after_forward, mp_policy=policy)
    saved = _custom_attributes(model)
    for unit in fsdp_units(model):
        for experts in expert_units(unit):
            _shard(experts, groups.experts, groups.dp_size, device, **options)
        _shard(unit, groups.dense, groups.dp_size, device, **options)
    _shard(model, groups.dense, groups.dp_size, device, **options)
    _restore_attributes(model, saved)
    return model


class FSDPReducer:
    """The Trainer's reducer under FSDP: gradients are FSDP's sharded `.grad`, reduce-scattered
    at the backward of the chunk's last micro batch; `no_sync` (every other backward) keeps
    them unsharded and accumulating, with no communication. `keep_gathered`
    (--no-fsdp-reshard-after-forward): the gathered parameters also stay from one micro
    batch to the next, so each unit is all-gathered once per global batch; the last
    backward frees them (the optimizer then steps the shards)."""

    def __init__(self, module: torch.nn.Module, keep_gathered: bool = False):
        self.module = module
        self.keep_gathered = keep_gathered

    def begin_step(self, num_micro_batches: int) -> None:
        pass

    def module_for_forward(self) -> torch.nn.Module:
        return self.module

    @contextlib.contextmanager
    def no_sync(self):
        """The backward inside neither reduce-scatters nor is the step's last."""
        self._set_sync(False)
        try:
            yield
        finally:
            self._set_sync(True)

    def _set_sync(self, sync: bool) -> None:
        self.module.set_requires_gradient_sync(sync)
        self.module.set_is_last_backward(sync)
        if self.keep_gathered:
            self.module.set_reshard_after_backward(sync)

    def finish_grad_sync(self) -> None:
        pass  # FSDP waits for its reduce-scatters at the end of the last backward

    def zero_grad(self) -> None:
        for p in self.module.parameters():
            p.grad = None
