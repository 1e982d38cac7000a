"""Optimizer, loss scaling and learning-rate schedule."""
from megatron.optimizer.grad_scaler import build_grad_scaler
from megatron.optimizer.lr_scheduler import LRScheduler, build_lr_scheduler, learning_rate
from megatron.optimizer.optimizer import MegatronOptimizer


def build_optimizer(config, models, pstate) -> MegatronOptimizer:
    scaler = build_grad_scaler(config.optimizer, config.training.fp16)
    return MegatronOptimizer(config.optimizer, models, pstate, scaler)


__all__ = ["MegatronOptimizer", "LRScheduler", "build_optimizer", "build_lr_scheduler",
           "learning_rate"]
