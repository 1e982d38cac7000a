"""Configuration of the training loop, optimizer, learning rate and precision."""
from dataclasses import dataclass
from typing import List, Optional

from megatron.config.batch_schedule import parse_step_schedule
from megatron.config.errors import require

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


@dataclass
class TrainingConfig:
    micro_batch_size: int = 1
    """Samples per forward/backward on one rank (--micro-batch-size)."""
    global_batch_size: Optional[int] = None
    """Samples per optimizer step over all DP ranks; micro-batch x DP when unset."""
    rampup_batch_size: Optional[List[int]] = None
    """START INCR SAMPLES: grow the global batch from START by INCR over SAMPLES."""
    step_batch_size_schedule: Optional[str] = None
    """"TOKENS:BATCH ...": the global batch as a step function of consumed tokens
    (--step-batch-size-schedule "0:16 2.4B:320"); see megatron/config/batch_schedule.py."""
    train_iters: Optional[int] = None
    train_samples: Optional[int] = None
    seed: int = 1234
    eval_interval: int = 1000
    eval_iters: int = 100
    exit_interval: Optional[int] = None
    """Stop (after saving) when the iteration is a multiple of this."""
    fp16: bool = False
    bf16: bool = False
    exit_signal_handler: bool = False
    """On SIGTERM finish the iteration, save and exit 0 (all ranks agree on the iteration)."""
    exit_duration_in_mins: Optional[float] = None
    """Save and stop after this many minutes of wall-clock time."""
    kill_switch_path: Optional[str] = None
    """Save and stop when this file exists."""
    check_for_nan_in_loss_and_grad: bool = False
    """Stop at the first non-finite loss or gradient, naming the rank and parameter."""
    max_consecutive_nan_iterations: int = 10
    """Stop with a non-zero status after this many nan/inf iterations in a row (0: never)."""
    train_tokens: Optional[int] = None
    """Stop after this many tokens (Megatron-DeepSpeed's --train-tokens; caps the iterations)."""
    skip_train_iteration_range: Optional[List[str]] = None
    """START-END ranges of iterations whose batches are consumed and dropped, untrained."""
    torch_compile: bool = False
    """torch.compile each transformer layer (--torch-compile)."""

    def __post_init__(self):
        self._check_skip_ranges()
        require(self.micro_batch_size > 0, f"--micro-batch-size must be positive, got {self.micro_batch_size}")
        self._check_counts()
        require((self.train_iters is None) != (self.train_samples is None),
                f"exactly one of --train-iters ({self.train_iters}) and --train-samples "
                f"({self.train_samples}) must be given")
        require(not (self.fp16 and self.bf16), "--fp16 and --bf16 cannot both be set; pick one")
        require(self.eval_interval > 0, f"--eval-interval must be positive, got {self.eval_interval}")
        require(self.eval_iters >= 0, f"--eval-iters must be >= 0, got {self.eval_iters}")
        if self.step_batch_size_schedule is not None:
            require(self.rampup_batch_size is None, "--step-batch-size-schedule and "
                    "--rampup-batch-size cannot both be given; pick one")
            parse_step_schedule(self.step_batch_size_schedule)
        if self.rampup_batch_size is not None:
            require(len(self.rampup_batch_size) == 3 and all(v > 0 for v in self.rampup_batch_size),
                    f"--rampup-batch-size takes START INCR SAMPLES (positive), got {self.rampup_batch_size}")

    def _check_counts(self):
        require(self.global_batch_size is None or self.global_batch_size > 0,
                f"--global-batch-size must be positive, got {self.global_batch_size}")
        for name in ("train_iters", "train_samples"):
            value = getattr(self, name)
            require(value is None or value >= 0, f"--{name.replace('_', '-')} must be >= 0, got {value}")
        require(self.seed >= 0, f"--seed must be >= 0, got {self.seed}")
        require(self.exit_interval is None or self.exit_interval > 0,
                f"--exit-interval must be positive, got {self.exit_interval}")
        require(self.exit_duration_in_mins is None or self.exit_duration_in_mins > 0,
                f"--exit-duration-in-mins must be positive, got {self.exit_duration_in_mins}")
        require(self.max_consecutive_nan_iterations >= 0,
                f"--max-consecutive-nan-iterations must be >= 0, got {self.max_consecutive_nan_iterations}")

    def _check_skip_ranges(self):
        for text in self.skip_train_iteration_range or []:
            start, _, end = str(text).partition("-")
            require(start.isdigit() and end.isdigit() and 0 < int(start) <= int(end),
                    f"--skip-train-iteration-range {text!r}: expected START-END with "
                    f"1 <= START <= END, e.g. 101-200")

    def skipped_iteration(self, iteration: int) -> bool:
        """True when `iteration` (1-based) lies in a --skip-train-iteration-range."""
        for text in self.skip_train_iteration_range or []:
            start, _, end = str(text).partition("-")
            if int(start) <= iteration <= int(end):
                return True
        return False


@dataclass
class OptimizerConfig:
    optimizer: str = "adam"
    lr: Optional[float] = None
    min_lr: float = 0.0
    lr_decay_style: str = "linear"
    lr_decay_iters: Optional[int] = None
    lr_decay_samples: Optional[int] = None
    lr_warmup_fraction: Optional[float] = None
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    loss_scale: Optional[float] = None
    """Static loss scale for fp16; dynamic scaling when unset."""
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    lr_decay_tokens: Optional[int] = None
    """Decay over this many tokens (Megatron-DeepSpeed); see lr_decay_samples_from_tokens."""
    lr_decay_samples_from_tokens: Optional[float] = None
    """--lr-decay-tokens / --seq-length (set by the parser): the decay length in samples,
    used whatever --train-iters or --train-samples say."""
    override_opt_param_scheduler: bool = False
    """On resume, take the lr schedule from the flags (--override-opt_param-scheduler)."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, take the lr schedule from the checkpoint."""

    def __post_init__(self):
        require(not (self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler),
                "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
                "are exclusive; pick one")
        require(self.optimizer in ("adam", "sgd"), f"--optimizer {self.optimizer!r} is not adam or sgd")
        require(self.lr is not None and self.lr > 0, f"--lr must be given and positive, got {self.lr}")
        require(self.min_lr <= self.lr, f"--min-lr ({self.min_lr}) must be <= --lr ({self.lr})")
        require(self.lr_decay_style in LR_DECAY_STYLES,
                f"--lr-decay-style {self.lr_decay_style!r} is not one of {LR_DECAY_STYLES}")
        if self.lr_warmup_fraction is not None:
            require(0.0 <= self.lr_warmup_fraction <= 1.0,
                    f"--lr-warmup-fraction must be in [0, 1], got {self.lr_warmup_fraction}")
            require(self.lr_warmup_iters == 0 and self.lr_warmup_samples == 0,
                    "--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are exclusive")
        require(self.clip_grad >= 0, f"--clip-grad must be >= 0, got {self.clip_grad}")
        require(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}")
        self._check_schedule_lengths()
        self._check_optimizer_constants()
        self._check_loss_scaling()

    def _check_schedule_lengths(self):
        require(self.min_lr >= 0, f"--min-lr must be >= 0, got {self.min_lr}")
        for name in ("lr_decay_iters", "lr_decay_samples"):
            value = getattr(self, name)
            require(value is None or value > 0, f"--{name.replace('_', '-')} must be positive, got {value}")
        for name in ("lr_warmup_iters", "lr_warmup_samples"):
            value = getattr(self, name)
            require(value >= 0, f"--{name.replace('_', '-')} must be >= 0, got {value}")

    def _check_optimizer_constants(self):
        for name in ("adam_beta1", "adam_beta2", "sgd_momentum"):
            value = getattr(self, name)
            require(0.0 <= value < 1.0, f"--{name.replace('_', '-')} must be in [0, 1), got {value}")
        require(self.adam_eps > 0, f"--adam-eps must be positive, got {self.adam_eps}")

    def _check_loss_scaling(self):
        require(self.loss_scale is None or self.loss_scale > 0,
                f"--loss-scale must be positive, got {self.loss_scale}")
        for name in ("initial_loss_scale", "min_loss_scale"):
            value = getattr(self, name)
            require(value > 0, f"--{name.replace('_', '-')} must be positive, got {value}")
        require(self.loss_scale_window > 0, f"--loss-scale-window must be positive, got {self.loss_scale_window}")
        require(self.hysteresis > 0, f"--hysteresis must be positive, got {self.hysteresis}")


@dataclass
class LoggingConfig:
    log_interval: int = 100
    tensorboard_dir: Optional[str] = None
    tensorboard_queue_size: int = 1000
    log_batch_size_to_tensorboard: bool = False
    log_validation_ppl_to_tensorboard: bool = False
    log_timers_to_tensorboard: bool = False
    timing_log_level: int = 0
    """0: iteration time only; 1: + forward/backward/optimizer; 2: + p2p and comm."""
    log_params_norm: bool = False
    """Add ' params norm: X |' to the log line."""
    log_num_zeros_in_grad: bool = False
    """Add ' num zeros: X |' (zero gradient entries) to the log line."""
    log_throughput: bool = False
    """TFLOP/s per device, tokens/s and MFU on every log line (--log-throughput)."""
    peak_flops: Optional[float] = None
    """Peak TFLOP/s of one device for MFU; a matmul probe at start-up when unset (--peak-flops)."""
    log_straggler: bool = False
    """Every --log-interval, rank 0 prints the slowest and fastest ranks' step compute times,
    their ratio and hosts (--log-straggler, megatron/training/straggler.py)."""
    straggler_minmax_count: int = 1
    """How many slowest and fastest ranks --log-straggler names (--straggler-minmax-count)."""

    def __post_init__(self):
        require(self.log_interval > 0, f"--log-interval must be positive, got {self.log_interval}")
        require(self.tensorboard_queue_size > 0,
                f"--tensorboard-queue-size must be positive, got {self.tensorboard_queue_size}")
        require(self.timing_log_level in (0, 1, 2),
                f"--timing-log-level must be 0, 1 or 2, got {self.timing_log_level}")
        require(self.straggler_minmax_count >= 1,
                f"--straggler-minmax-count must be at least 1, got {self.straggler_minmax_count}")
        require(self.peak_flops is None or self.peak_flops > 0,
                f"--peak-flops must be a positive TFLOP/s value, got {self.peak_flops}")
