"""Number of micro batches per step, constant or with a batch-size ramp-up."""
from megatron.config import ConfigError


class MicroBatches:
    """Global batch = micro batch x DP x number of micro batches.

    With `rampup` = (START, INCR, SAMPLES) the global batch starts at START and
    grows by INCR every SAMPLES / ((global - START) / INCR) consumed samples
    until it reaches the configured global batch size.
    """

    def __init__(self, global_batch_size: int, micro_batch_size: int, dp_size: int, rampup=None):
        self.final_global = global_batch_size
        self.per_micro = micro_batch_size * dp_size
        self.rampup = rampup
        if rampup is not None:
            start, incr, _ = rampup
            if (global_batch_size - start) % incr != 0 or start > global_batch_size:
                raise ConfigError(
                    f"--rampup-batch-size START ({start}) must be <= --global-batch-size "
                    f"({global_batch_size}) and their difference divisible by INCR ({incr})")
        self.global_batch_size = global_batch_size
        self.update(0)

    def update(self, consumed_samples: int) -> None:
        if self.rampup is None:
            self.global_batch_size = self.final_global
            return
        start, incr, samples = self.rampup
        steps = (self.final_global - start) // incr
        if steps == 0:
            self.global_batch_size = self.final_global
            return
        per_step = samples / steps
        grown = start + int(consumed_samples // per_step) * incr
        self.global_batch_size = min(grown, self.final_global)

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // self.per_micro
