"""The optional log-line statistics --log-params-norm and --log-num-zeros-in-grad.

Each counts a parameter once over the model-parallel group (see
megatron.distributed.grads.counts_for_norm), as the gradient norm does.
"""
from typing import List

import torch

from megatron.distributed.grads import (counted_parts, counts_for_norm, expert_norm_groups, grad_of,
                                       norm_and_nonfinite)
from megatron.mpu.mappings import all_reduce, group_rank, group_size


def _counted(models, pstate) -> List[torch.nn.Parameter]:
    tp_rank, etp_rank = group_rank(pstate.tp_group), getattr(pstate, "etp_rank", 0)
    own = getattr(pstate, "expert_mp_group", None) is not None  # experts split by expert TP
    return [p for m in models for p in m.parameters()
            if counts_for_norm(p, etp_rank if own and getattr(p, "expert_parallel", False)
                               else tp_rank)]


def params_norm(models, pstate) -> float:
    """L2 norm of all model parameters (Megatron's ` params norm:`)."""
    params = _counted(models, pstate)
    norm, _ = norm_and_nonfinite(params, [p.detach() for p in params], pstate.tp_group,
                                 pstate.mp_group, **expert_norm_groups(pstate))
    return norm


def num_zeros_in_grad(models, pstate) -> int:
    """Gradient entries equal to zero after the last step's reduction (` num zeros:`): the
    dense ones summed over TP x PP, the experts' over their own group (ETP x EP x PP) when
    they have one, each shard once, as the gradient norm."""
    tp_rank, tp = group_rank(pstate.tp_group), group_size(pstate.tp_group)
    expert_group = getattr(pstate, "expert_mp_group", None)
    params = [p for p in _counted(models, pstate) if grad_of(p) is not None]
    device = grad_of(params[0]).device if params else torch.device("cpu")
    dense, expert = (torch.zeros(1, dtype=torch.float64, device=device) for _ in range(2))
    for p in params:
        if expert_group is not None and getattr(p, "expert_parallel", False):
            expert += (grad_of(p) == 0).sum()
            continue
        for part, keep in counted_parts(p, grad_of(p), tp_rank, tp):
            if keep:
                dense += (part == 0).sum()
    all_reduce(dense, pstate.mp_group)
    if expert_group is not None:
        all_reduce(expert, expert_group)
    return int((dense + expert).item())


def log_line_extras(cfg, models, pstate) -> str:
    """The ` params norm: X | num zeros: N |` fields the logging flags ask for."""
    text = ""
    if cfg.logging.log_num_zeros_in_grad:
        text += f" num zeros: {num_zeros_in_grad(models, pstate):.1f} |"
    if cfg.logging.log_params_norm:
        text += f" params norm: {params_norm(models, pstate):.3f} |"
    return text
