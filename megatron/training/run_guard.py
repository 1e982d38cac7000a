"""What the training loop checks after each iteration: numerical faults, stop
requests, and (around the step) hangs. Ranks agree with one small all-reduce per
iteration, so every rank stops at the same iteration."""
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist

from megatron.training.children import stop_children
from megatron.training.elastic_events import stop_cut_off_agent, unreachable_store
from megatron.training.hang_guard import DistributedTimeoutError, HangGuard
from megatron.training.nan_guard import NanGuard, NumericalError, is_bad_iteration
from megatron.training.preemption import StopRequests


class RunGuard:
    def __init__(self, config, pstate, device):
        self.config, self.pstate, self.device = config, pstate, device
        self.hangs = HangGuard(pstate, config.parallel.distributed_timeout_minutes)
        self.stops = StopRequests(config.training)
        self.nans = None
        self.reason: Optional[str] = None

    def attach(self, trainer) -> None:
        self.nans = NanGuard(self.config.training, trainer.models, self.pstate.rank)
        self.hangs.timers = trainer.timers

    def should_stop(self, iteration: int, losses, grad_norm, nan) -> bool:
        """Raise NumericalError on nan/inf; True when the run should save and stop now."""
        local_reason = self.stops.reason()
        flags = [float(is_bad_iteration(losses, grad_norm, nan)), float(local_reason is not None)]
        if dist.is_initialized():
            agreed = torch.tensor(flags, device=self.device)
            with self.hangs.watch(iteration, "the all-reduce of the stop flags"):
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            flags = agreed.tolist()
        self.nans.check(iteration, flags[0] > 0)
        if flags[1] > 0:
            self.reason = local_reason or "another rank was asked to stop"
            return True
        return False

    def close(self) -> None:
        self.stops.close()


def exit_on_run_failure(err: BaseException) -> None:
    """One line and exit 1. After a timeout the peers may never answer again, so
    the process leaves without the usual clean-up (which would wait for them). A rank whose
    peers went silent and whose host cannot reach torchrun's rendezvous store either is on a
    host cut off from the job: it says so and stops its agent too (elastic_events.py)."""
    store = unreachable_store() if getattr(err, "silent", False) else None
    cut_off = (f", and this host cannot reach the rendezvous store {store} either: it is cut "
               f"off from the job; stopping its torchrun agent too" if store else "")
    print(f"{os.path.basename(sys.argv[0])}: error: {err}{cut_off}", file=sys.stderr, flush=True)
    if isinstance(err, DistributedTimeoutError):
        sys.stdout.flush()
        stop_children()  # os._exit skips the exit hooks
        if store:
            stop_cut_off_agent()
        os._exit(1)
    sys.exit(1)


RUN_FAILURES = (NumericalError, DistributedTimeoutError)
