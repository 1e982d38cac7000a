"""Numerical faults: stop on a nan/inf loss or gradient instead of training on.

With --check-for-nan-in-loss-and-grad the first such iteration stops the run,
naming the iteration, the rank and the first parameter whose gradient is not
finite. Otherwise --max-consecutive-nan-iterations (default 10) such iterations in
a row stop it. An iteration counts when its loss or gradient norm is nan/inf or
its gradients were not finite (the step was then not applied); an fp16 overflow
that loss scaling skips on purpose does not count.
"""
import math
from typing import Dict, Optional

import torch

from megatron.mpu.fsdp_shards import local


class NumericalError(RuntimeError):
    """Training produced non-finite values; the message says where."""


def is_bad_iteration(losses: Dict[str, float], grad_norm: Optional[float], nan: bool) -> bool:
    return (nan or any(not math.isfinite(v) for v in losses.values())
            or (grad_norm is not None and not math.isfinite(grad_norm)))


def first_nonfinite_grad(models) -> Optional[str]:
    """Name of the first parameter (in model order) whose gradient holds a nan or inf."""
    for index, model in enumerate(models):
        for name, param in model.named_parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is not None and not bool(torch.isfinite(local(grad)).all()):
                return name if len(models) == 1 else f"model chunk {index}: {name}"
    return None


class NanGuard:
    def __init__(self, training_config, models, rank: int):
        self.strict = training_config.check_for_nan_in_loss_and_grad
        self.limit = training_config.max_consecutive_nan_iterations
        self.models, self.rank = models, rank
        self.consecutive = 0

    def check(self, iteration: int, bad: bool) -> None:
        """`bad`: this iteration (agreed over all ranks) had a nan/inf loss or gradient."""
        if not bad:
            self.consecutive = 0
            return
        self.consecutive += 1
        if self.strict:
            name = first_nonfinite_grad(self.models)
            where = (f"first parameter with a non-finite gradient: {name}" if name else
                     "no non-finite gradient on this rank (another rank's loss or gradient)")
            raise NumericalError(f"iteration {iteration}: nan/inf loss or gradient on rank "
                                 f"{self.rank} ({where}); --check-for-nan-in-loss-and-grad stops here")
        if self.limit and self.consecutive >= self.limit:
            raise NumericalError(f"iteration {iteration}: {self.consecutive} iterations in a row with a "
                                 f"nan/inf loss or gradient norm (--max-consecutive-nan-iterations "
                                 f"{self.limit}); lower --lr, check the data, or resume from the last "
                                 f"checkpoint")
