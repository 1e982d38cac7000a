"""Learning-rate schedule: a pure function of the number of samples consumed.

As in Megatron, steps are counted in samples (iterations x global batch), so a
batch-size ramp-up moves the schedule by the samples actually seen.
"""
import math
from dataclasses import dataclass


def learning_rate(step: int, *, max_lr: float, min_lr: float, warmup_steps: int,
                  decay_steps: int, style: str) -> float:
    """lr after `step` samples: linear warm-up from 0, then decay to min_lr."""
    if warmup_steps > 0 and step <= warmup_steps:
        return max_lr * step / warmup_steps
    if style == "constant":
        return max_lr
    if style == "inverse-square-root":
        warmup = max(warmup_steps, 1)
        return max(min_lr, max_lr * math.sqrt(warmup) / math.sqrt(max(step, 1)))
    if step > decay_steps:
        return min_lr
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
        return {"max_lr": self.max_lr, "min_lr": self.min_lr, "warmup_steps": self.warmup_steps,
                "decay_steps": self.decay_steps, "decay_style": self.style,
                "num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        """Resume the step count; the schedule itself comes from the current flags."""
        self.num_steps = int(state["num_steps"])
        self.step(0)


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
                       style=opt_cfg.lr_decay_style)
