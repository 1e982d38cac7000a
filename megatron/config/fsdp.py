"""What --use-torch-fsdp2 composes with (megatron/distributed/fsdp.py), checked up front."""
from megatron.config.errors import require

DCP_FORMATS = ("torch_dist", "torch_dcp")
"""The checkpoint formats FSDP's shards are saved in (torch.distributed.checkpoint)."""


def check_fsdp(config, dp: int) -> None:
    """Refuse, naming the flags, each combination FSDP here does not serve."""
    p, t = config.parallel, config.training
    if not p.use_torch_fsdp2:
        return
    refused = [
        (p.use_distributed_optimizer, "--use-distributed-optimizer (FSDP already shards the "
                                      "optimizer state; drop one of them)"),
        (p.DDP_impl == "torch", "--DDP-impl torch (FSDP reduces the gradients itself)"),
        (t.fp16, "--fp16 (loss scaling is not done under FSDP; use --bf16)"),
        (t.torch_compile, "--torch-compile"),
        (dp * p.context_parallel_size == 1, "a data-parallel x context-parallel size of 1 "
                                            "(nothing to shard; launch more ranks or drop it)"),
        (config.checkpoint.ckpt_format not in DCP_FORMATS and (config.checkpoint.save or
                                                              config.checkpoint.load),
         f"--ckpt-format {config.checkpoint.ckpt_format} (use --ckpt-format torch_dist or "
         f"torch_dcp)"),
    ]
    for bad, what in refused:
        require(not bad, f"--use-torch-fsdp2 is not supported with {what}")
