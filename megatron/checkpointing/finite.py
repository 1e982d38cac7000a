"""nan/inf refused at load: a checkpoint saved by a run that had diverged is named at once
(the weight, or the optimizer state and the parameter it belongs to), never trained on."""
from typing import Dict, Iterable, Tuple

import torch

from megatron.checkpointing.io import CheckpointError
from megatron.mpu.fsdp_shards import local

_ADVICE = "the run that saved it had diverged: load an earlier iteration"


def nonfinite(value) -> int:
    """How many nan/inf values a floating-point tensor holds (0 for anything else)."""
    if not (torch.is_tensor(value) and value.is_floating_point()):
        return 0
    return int((~torch.isfinite(local(value))).sum())  # FSDP: this rank's shard


def finite_model_state(flat: Dict[str, torch.Tensor], root: str) -> Dict[str, torch.Tensor]:
    """`flat` itself, once every floating-point tensor in it is finite (else CheckpointError
    naming the first parameter holding nan/inf)."""
    for name, tensor in flat.items():
        bad = nonfinite(tensor)
        if bad:
            raise CheckpointError(f"checkpoint {root}: parameter {name} holds {bad} nan/inf "
                                  f"values; {_ADVICE}")
    return flat


def _main_params(optimizer, models) -> Iterable[Tuple[str, torch.Tensor]]:
    """(model parameter name, the tensor the torch optimizer steps for it) of this rank."""
    name_of = {id(p): n for model in models for n, p in model.named_parameters()}
    if optimizer.is_distributed:  # pieces of parameters: one name may appear several times
        return [(name_of.get(id(p.param), "?"), p.main) for p in optimizer.pieces]
    return [(name_of.get(id(p), "?"), main)
            for p, main in zip(optimizer.model_params, optimizer.main_params)]


def check_finite_optimizer(optimizer, models, root: str) -> None:
    """After a load: every loaded optimizer tensor (the fp32 main parameters, each
    parameter's state such as Adam's exp_avg / exp_avg_sq) is finite, else CheckpointError
    naming the state and its parameter."""
    states = optimizer.optimizer.state
    for name, main in _main_params(optimizer, models):
        kinds = [("fp32 main parameter", main)]
        kinds += sorted((key, value) for key, value in states.get(main, {}).items()
                        if torch.is_tensor(value))
        for kind, value in kinds:
            bad = nonfinite(value)
            if bad:
                raise CheckpointError(f"checkpoint {root}: optimizer state {kind} of {name} "
                                      f"holds {bad} nan/inf values; {_ADVICE} (or pass "
                                      f"--no-load-optim to start the optimizer afresh)")
