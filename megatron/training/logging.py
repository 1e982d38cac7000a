"""Timers, the Megatron training log line, and TensorBoard scalars."""
import time
from collections import defaultdict
from typing import Dict, Optional

import torch


class Timers:
    """Named wall-clock timers; `log_level` decides which are recorded.

    A recorded timer synchronises the device at start and stop, so a name missing
    from LEVELS (e.g. the pipeline's combined exchanges, `forward-send-backward-recv`)
    counts as the highest level: recorded only at --timing-log-level 2.
    """

    LEVELS = {"forward-compute": 1, "backward-compute": 1, "optimizer": 1, "batch-generator": 1,
              "forward-recv": 2, "forward-send": 2, "backward-recv": 2, "backward-send": 2,
              "grads-all-reduce": 2, "embedding-grads-all-reduce": 2}
    MAX_LEVEL = 2

    def __init__(self, log_level: int = 0, always=(), wait_clock=None):
        self.log_level = log_level
        self.always = frozenset(always)
        """Names recorded at any level (--log-straggler's compute timers)..."""
        self.wait_clock = wait_clock
        """...and, with a clock (mpu.mappings.COLLECTIVE_WAIT), the seconds of collectives
        inside them, in `waits`."""
        self.waits = defaultdict(float)
        self._wait_start: Dict[str, float] = {}
        self.elapsed = defaultdict(float)
        self._start: Dict[str, float] = {}
        self.current: Optional[str] = None
        """The phase started last (at any level; kept after it stops, also when it
        stops by an exception): what a timeout message names."""

    def enabled(self, name: str) -> bool:
        return name in self.always or self.LEVELS.get(name, self.MAX_LEVEL) <= self.log_level

    def start(self, name: str) -> None:
        self.current = name
        if self.enabled(name):
            _sync()
            self._start[name] = time.perf_counter()
            if self.wait_clock is not None and name in self.always:
                self._wait_start[name] = self.wait_clock.seconds

    def stop(self, name: str) -> None:
        if name in self._start:
            _sync()
            self.elapsed[name] += time.perf_counter() - self._start.pop(name)
        if name in self._wait_start:
            self.waits[name] += self.wait_clock.seconds - self._wait_start.pop(name)

    def __call__(self, name: str) -> "_Handle":
        """`timers(name).start()` / `.stop()`, the form the pipeline executor uses."""
        return _Handle(self, name)

    def pop_all(self) -> Dict[str, float]:
        out, self.elapsed = dict(self.elapsed), defaultdict(float)
        return out

    def pop_waits(self) -> Dict[str, float]:
        out, self.waits = dict(self.waits), defaultdict(float)
        return out


class _Handle:
    def __init__(self, timers: Timers, name: str):
        self.timers, self.name = timers, name

    def start(self):
        self.timers.start(self.name)

    def stop(self):
        self.timers.stop(self.name)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def format_log_line(iteration: int, train_iters: int, consumed: int, ms_per_iter: float,
                    lr: float, global_batch: int, losses: Dict[str, float], loss_scale: float,
                    grad_norm: Optional[float], skipped: int, nans: int,
                    throughput: str = "", extras: str = "") -> str:
    """The training log line, in Megatron's shape so existing parsers keep working.
    `throughput`: the --log-throughput fields, placed after the iteration time as Megatron-LM;
    `extras`: the --log-num-zeros-in-grad / --log-params-norm fields after the grad norm."""
    line = f" iteration {iteration:8d}/{train_iters:8d} |"
    line += f" consumed samples: {consumed:12d} |"
    line += f" elapsed time per iteration (ms): {ms_per_iter:.1f} |"
    line += throughput
    line += f" learning rate: {lr:.3E} |"
    line += f" global batch size: {global_batch:5d} |"
    for key, value in losses.items():
        line += f" {key}: {value:.6E} |"
    line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    line += extras  # " num zeros: N | params norm: X |" (--log-num-zeros-in-grad, --log-params-norm)
    line += f" number of skipped iterations: {skipped:3d} |"
    line += f" number of nan iterations: {nans:3d} |"
    return line


def format_validation(prefix: str, losses: Dict[str, float]) -> str:
    import math
    line = f" validation loss at {prefix} | "
    for key, value in losses.items():
        line += f"{key} value: {value:.6E} | {key} PPL: {math.exp(min(20.0, value)):.6E} | "
    return line


class TensorBoard:
    """A SummaryWriter when --tensorboard-dir is set and tensorboard is installed."""

    def __init__(self, log_dir: Optional[str], queue_size: int = 1000):
        self.writer = None
        if log_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print("WARNING: tensorboard is not installed; --tensorboard-dir ignored "
                      "(pip install tensorboard)", flush=True)
                return
            self.writer = SummaryWriter(log_dir=log_dir, max_queue=queue_size)

    def scalars(self, values: Dict[str, float], step: int) -> None:
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
