"""Learning-rate schedule: a pure function of the number of samples consumed.

As in Megatron, steps are counted in samples (iterations x global batch), so a
batch-size ramp-up moves the schedule by the samples actually seen.
"""
import math
from dataclasses import dataclass

from megatron.config import ConfigError

# Our attribute, its label in errors, and the keys Megatron-LM (first) and Megatron-DeepSpeed
# (and older Megatron) store it under.
_SAVED_KEYS = (
    ("max_lr", "max_lr", ("max_lr", "start_lr")),
    ("min_lr", "min_lr", ("min_lr",)),
    ("warmup_steps", "warmup steps", ("lr_warmup_steps", "warmup_steps", "warmup_iter")),
    ("decay_steps", "decay steps", ("lr_decay_steps", "decay_steps", "end_iter")),
    ("style", "decay style", ("lr_decay_style", "decay_style")),
)


def learning_rate(step: int, *, max_lr: float, min_lr: float, warmup_steps: int,
                  decay_steps: int, style: str) -> float:
    """lr after `step` samples: linear warm-up from 0, then decay to min_lr, and min_lr after
    `decay_steps` whatever the style but constant (Megatron-Core's OptimizerParamScheduler)."""
    if warmup_steps > 0 and step <= warmup_steps:
        return max_lr * step / warmup_steps
    if style == "constant":
        return max_lr
    if step > decay_steps:
        return min_lr
    if style == "inverse-square-root":
        warmup = max(warmup_steps, 1)
        return max(min_lr, max_lr * math.sqrt(warmup) / math.sqrt(max(step, 1)))
    span = decay_steps - warmup_steps
    ratio = (step - warmup_steps) / span if span > 0 else 1.0
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ValueError(f"unknown lr decay style {style!r}")
    return min_lr + coeff * (max_lr - min_lr)


@dataclass
class LRScheduler:
    """Applies `learning_rate` to an optimizer's parameter groups each step."""

    optimizer: object
    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    style: str
    num_steps: int = 0
    override: bool = False
    """On resume, keep the schedule from the flags (--override-opt_param-scheduler)."""
    use_checkpoint: bool = False
    """On resume, take the schedule from the checkpoint (--use-checkpoint-opt_param-scheduler)."""

    def __post_init__(self):
        self.step(0)

    def get_lr(self) -> float:
        return learning_rate(self.num_steps, max_lr=self.max_lr, min_lr=self.min_lr,
                             warmup_steps=self.warmup_steps, decay_steps=self.decay_steps,
                             style=self.style)

    def step(self, increment: int) -> None:
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)

    def state_dict(self) -> dict:
        """Under Megatron-LM's keys (opt_param_scheduler) and Megatron-DeepSpeed's (lr_scheduler)."""
        return {"max_lr": self.max_lr, "min_lr": self.min_lr, "num_steps": self.num_steps,
                "lr_warmup_steps": self.warmup_steps, "lr_decay_steps": self.decay_steps,
                "lr_decay_style": self.style, "warmup_steps": self.warmup_steps,
                "decay_steps": self.decay_steps, "decay_style": self.style,
                "num_tokens": 0, "warmup_tokens": 0, "decay_tokens": None}

    def load_state_dict(self, state: dict) -> None:
        """Resume the step count. The schedule must equal the flags' unless --override-... (the
        flags win) or --use-checkpoint-... (the checkpoint's wins) is given, as in Megatron."""
        for attr, label, keys in _SAVED_KEYS:
            saved = next((state[k] for k in keys if k in state), None)
            if saved is not None:
                setattr(self, attr, self._check_and_set(getattr(self, attr), saved, label))
        self.num_steps = int(state["num_steps"] if "num_steps" in state else state["num_iters"])
        self.step(0)

    def _check_and_set(self, ours, saved, label: str):
        if self.override:
            return ours
        if not self.use_checkpoint and ours != saved:
            raise ConfigError(f"the checkpoint's lr schedule has {label} {saved} but the flags give "
                              f"{ours}; pass --override-opt_param-scheduler to use the flags or "
                              f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's")
        return saved


def build_lr_scheduler(optimizer, opt_cfg, train_cfg) -> LRScheduler:
    """Warm-up and decay lengths in samples, from iterations or samples flags."""
    gbs = train_cfg.global_batch_size
    if train_cfg.train_iters is not None:
        decay_iters = opt_cfg.lr_decay_iters or train_cfg.train_iters
        decay_steps = decay_iters * gbs
        warmup_steps = opt_cfg.lr_warmup_iters * gbs
    else:
        decay_steps = opt_cfg.lr_decay_samples or train_cfg.train_samples
        warmup_steps = opt_cfg.lr_warmup_samples
    if opt_cfg.lr_decay_samples_from_tokens is not None:  # --lr-decay-tokens
        decay_steps = opt_cfg.lr_decay_samples_from_tokens
    if opt_cfg.lr_warmup_fraction is not None:
        warmup_steps = int(opt_cfg.lr_warmup_fraction * decay_steps)
    return LRScheduler(optimizer, max_lr=opt_cfg.lr, min_lr=opt_cfg.min_lr,
                       warmup_steps=warmup_steps, decay_steps=decay_steps,
                       style=opt_cfg.lr_decay_style,
                       override=opt_cfg.override_opt_param_scheduler,
                       use_checkpoint=opt_cfg.use_checkpoint_opt_param_scheduler)
