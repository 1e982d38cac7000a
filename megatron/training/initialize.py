"""Process start-up: torch.distributed, model-parallel groups, device and seeds."""
import datetime
import os
import random

import numpy as np
import torch
import torch.distributed as dist

from megatron.config import ConfigError
from megatron.lifetime import die_with_parent, launched
from megatron.training.launch_env import check_socket_ifnames, host_interfaces
from megatron.mpu import initialize_model_parallel, model_parallel_seed


def choose_backend(requested):
    """nccl with CUDA, else gloo; an explicit --distributed-backend wins."""
    if requested:
        if requested == "nccl" and not torch.cuda.is_available():
            raise ConfigError("--distributed-backend nccl needs CUDA GPUs; use gloo on CPUs "
                              "(or leave the flag out: nccl with CUDA, gloo otherwise)")
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def initialize_distributed(config):
    """Start torch.distributed when launched with several processes, build the
    parallel groups, pick the device and seed every generator.

    Works as a plain `python` process (one rank, no process group), under
    torchrun, under `python -m torch.distributed.launch` and as a task of `srun` or `mpirun` (the
    entry point applies launch_env.apply_launcher_environment first). GLOO_SOCKET_IFNAME /
    NCCL_SOCKET_IFNAME naming no interface of this host is a ConfigError (per_host). A rank started by a launcher
    dies with it (megatron/lifetime.py): a killed job never keeps training or holding --save.
    """
    if launched():
        die_with_parent()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not dist.is_initialized():  # this host's names, before the backend's
        check_socket_ifnames(os.environ, host_interfaces(),  # own checks (nccl needs a GPU)
                             config.parallel.distributed_backend or choose_backend(None))
    backend = choose_backend(config.parallel.distributed_backend)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    timeout = datetime.timedelta(minutes=config.parallel.distributed_timeout_minutes)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timeout)
    pstate = initialize_model_parallel(config.parallel.tensor_model_parallel_size,
                                       config.parallel.pipeline_model_parallel_size,
                                       config.virtual_pipeline_size, timeout=timeout,
                                       cp=config.parallel.context_parallel_size,
                                       ep=config.parallel.expert_model_parallel_size,
                                       etp=config.parallel.expert_tp)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    set_seeds(config.training.seed, pstate)
    return pstate, device


def set_seeds(seed: int, pstate) -> None:
    """Different seeds per pipeline stage (as Megatron), equal across TP and DP;
    the tracker's model-parallel state adds 2718 + tp_rank."""
    seed = seed + 100 * pstate.pp_rank
    random.seed(seed)
    np.random.seed(seed)
    model_parallel_seed(seed, pstate.tp_rank)
