"""--use-torch-fsdp2: parameters, gradients and optimizer state sharded over data parallelism
by torch's FSDP2 (`torch.distributed.fsdp.fully_shard`).

Each transformer layer is an FSDP unit, and so is the input embedding of an untied model;
the root unit (the whole chunk) holds the rest: the final norm and the output layer, and the
word embeddings of a tied model (used twice in one forward, by the embedding and the head,
they must live in one unit). The units shard over the data-parallel group: every parameter
becomes a DTensor split along dim 0 over DP (after TP has split it, so TP sits inside a 2-D
layout). Gradients are reduce-scattered by FSDP, averaged over DP, in fp32
(`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` with --bf16: the sharded
parameters themselves stay fp32 and serve as the optimizer's main parameters).

`FSDPReducer` stands in for our gradient reducer: FSDP does the reduction itself, during
each micro batch's backward, so there is nothing left to finish.

`local_shards` gives each parameter's (or gradient's) local shard and where it starts in
the flattened TP-local tensor: what the norms (clipping, --log-params-norm, zeros) count,
summed over the DP group once, each shard exactly once.
"""
import contextlib
from typing import Dict, List, Optional, Tuple

import torch

from megatron.mpu.fsdp_shards import local, shard_start


def local_shards(params, grads) -> Tuple[List, List, List[int]]:
    """(params, local gradient shards, starts) for norm_and_nonfinite / norm_parts."""
    return (list(params), [local(g) for g in grads],
            [shard_start(g) if g is not None else 0 for g in grads])


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


def apply_fsdp(model: torch.nn.Module, dp_group, device: torch.device,
               reshard_after_forward: bool = True,
               param_dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
    """Shard `model` (fp32 parameters on `device`) over `dp_group` with FSDP2, in place;
    `param_dtype` (bf16): the dtype the gathered parameters compute in, gradients reduced
    in fp32."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = DeviceMesh.from_group(dp_group, device.type)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype,
                                  reduce_dtype=torch.float32 if param_dtype else None)
    saved = _custom_attributes(model)
    for unit in fsdp_units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    _restore_attributes(model, saved)
    return model


class FSDPReducer:
    """The Trainer's reducer under FSDP: gradients are FSDP's sharded `.grad`, reduce-scattered
    over DP at every micro batch's backward (accumulated there in fp32)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def begin_step(self, num_micro_batches: int) -> None:
        pass

    def module_for_forward(self) -> torch.nn.Module:
        return self.module

    def no_sync(self):
        return contextlib.nullcontext()  # every backward reduce-scatters (see the docstring)

    def finish_grad_sync(self) -> None:
        pass  # FSDP waits for its reduce-scatters at the end of backward

    def zero_grad(self) -> None:
        for p in self.module.parameters():
            p.grad = None
