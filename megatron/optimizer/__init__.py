"""Optimizer, loss scaling and learning-rate schedule."""
from megatron.optimizer.distributed import DistributedOptimizer, merge_optimizer_shards
from megatron.optimizer.fsdp import FSDPOptimizer
from megatron.optimizer.grad_scaler import build_grad_scaler
from megatron.optimizer.lr_scheduler import LRScheduler, build_lr_scheduler, learning_rate
from megatron.optimizer.optimizer import MegatronOptimizer


def build_optimizer(config, models, pstate, reducers=None):
    """MegatronOptimizer, FSDPOptimizer with --use-torch-fsdp2, or with --use-distributed-optimizer the DP-sharded
    DistributedOptimizer (which needs the models' reduce-scattering `reducers`)."""
    scaler = build_grad_scaler(config.optimizer, config.training.fp16, config.training.bf16)
    if config.parallel.use_torch_fsdp2:
        return FSDPOptimizer(config.optimizer, models, pstate, scaler,
                             fp32_main_params=config.training.bf16)
    if config.parallel.use_distributed_optimizer:
        if reducers is None:
            raise ValueError("--use-distributed-optimizer needs the models' gradient reducers")
        return DistributedOptimizer(config.optimizer, models, pstate, reducers, scaler)
    return MegatronOptimizer(config.optimizer, models, pstate, scaler)


__all__ = ["MegatronOptimizer", "DistributedOptimizer", "LRScheduler", "build_optimizer",
           "build_lr_scheduler", "learning_rate", "merge_optimizer_shards"]
