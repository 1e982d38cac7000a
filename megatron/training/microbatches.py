"""Number of micro batches per step, constant or with a batch-size ramp-up."""
from megatron.config import ConfigError
from megatron.config.batch_schedule import batch_at, parse_step_schedule


class MicroBatches:
    """Global batch = micro batch x DP x number of micro batches.

    With `rampup` = (START, INCR, SAMPLES) the global batch starts at START and
    grows by INCR every SAMPLES / ((global - START) / INCR) consumed samples
    until it reaches the configured global batch size.
    """

    def __init__(self, global_batch_size: int, micro_batch_size: int, dp_size: int, rampup=None,
                 step_schedule=None, seq_length: int = 0):
        """`step_schedule`: --step-batch-size-schedule's [(tokens, batch)] (a sample is
        `seq_length` tokens)."""
        self.final_global = global_batch_size
        self.per_micro = micro_batch_size * dp_size
        self.rampup = rampup
        self.step_schedule, self.seq_length = step_schedule, seq_length
        if rampup is not None:
            start, incr, _ = rampup
            if (global_batch_size - start) % incr != 0 or start > global_batch_size:
                raise ConfigError(
                    f"--rampup-batch-size START ({start}) must be <= --global-batch-size "
                    f"({global_batch_size}) and their difference divisible by INCR ({incr})")
        self.global_batch_size = global_batch_size
        self.update(0)

    def update(self, consumed_samples: int) -> None:
        if self.step_schedule is not None:
            self.global_batch_size = batch_at(self.step_schedule, consumed_samples * self.seq_length)
            return
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

    @classmethod
    def of(cls, config, dp_size: int) -> "MicroBatches":
        """The batch schedule the flags of `config` describe."""
        t = config.training
        steps = t.step_batch_size_schedule
        return cls(t.global_batch_size, t.micro_batch_size, dp_size, t.rampup_batch_size,
                   parse_step_schedule(steps) if steps else None, config.model.seq_length)

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // self.per_micro
