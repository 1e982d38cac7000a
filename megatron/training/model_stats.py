"""The optional log-line statistics --log-params-norm and --log-num-zeros-in-grad.

Each counts a parameter shard once over the model-parallel ranks (see
megatron.distributed.grads.norm_parts), as the gradient norm does.
"""
from typing import List

import torch

from megatron.distributed.fsdp import local_shards, shard_groups
from megatron.mpu.fsdp_shards import is_sharded
from megatron.distributed.grads import expert_norm_groups, grad_of, norm_and_nonfinite, norm_parts
from megatron.mpu.mappings import all_reduce


def _params(models) -> List[torch.nn.Parameter]:
    return [p for m in models for p in m.parameters()]


def _with_grads(models):
    """(parameters, their gradients) of `models`, the parameters without one left out."""
    params = [p for p in _params(models) if grad_of(p) is not None]
    return params, [grad_of(p) for p in params]


def _shard_groups(params, pstate) -> dict:
    """The groups over which FSDP's shards (DTensors) are summed (dense, experts); none
    without FSDP."""
    return shard_groups(pstate) if any(is_sharded(p) for p in params) else {}


def params_norm(models, pstate) -> float:
    """L2 norm of all model parameters (Megatron's ` params norm:`); FSDP's local shards
    summed over the groups they shard over."""
    params = _params(models)
    params, tensors, starts = local_shards(params, [p.detach() for p in params])
    norm, _ = norm_and_nonfinite(params, tensors, pstate.tp_group, pstate.mp_group,
                                 starts=starts, **_shard_groups(params, pstate),
                                 **expert_norm_groups(pstate))
    return norm


def num_zeros_in_grad(models, pstate) -> int:
    """Gradient entries equal to zero after the last step's reduction (` num zeros:`), each
    shard counted once as in the gradient norm (norm_parts): the dense ones summed over
    TP x PP, the experts' over their own group (ETP x EP x PP) when they have one."""
    groups = expert_norm_groups(pstate)
    own = groups["expert_mp_group"] is not None
    params, grads, starts = local_shards(*_with_grads(models))
    parts = norm_parts(params, grads, pstate.tp_group, starts=starts, **groups)
    device = parts[0][1].device if parts else torch.device("cpu")
    dense, expert = (torch.zeros(1, dtype=torch.float64, device=device) for _ in range(2))
    for p, part, counted, _ in parts:
        if counted:
            total = expert if own and getattr(p, "expert_parallel", False) else dense
            total += (part == 0).sum()
    shards = _shard_groups(params, pstate)
    if shards:
        all_reduce(dense, shards["dp_group"])
        if own:
            all_reduce(expert, shards["edp_group"])
    all_reduce(dense, pstate.mp_group)
    if own:
        all_reduce(expert, groups["expert_mp_group"])
    return int((dense + expert).item())


def log_line_extras(cfg, models, pstate) -> str:
    """The ` params norm: X | num zeros: N |` fields the logging flags ask for."""
    text = ""
    if cfg.logging.log_num_zeros_in_grad:
        text += f" num zeros: {num_zeros_in_grad(models, pstate):.1f} |"
    if cfg.logging.log_params_norm:
        text += f" params norm: {params_norm(models, pstate):.3f} |"
    return text
