"""Configuration of tensor, pipeline and data parallelism."""
from dataclasses import dataclass
from typing import Optional

from megatron.config.errors import require


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """Ranks that split each layer (--tensor-model-parallel-size)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages (--pipeline-model-parallel-size)."""
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Layers per virtual stage for the interleaved schedule."""
    pipeline_model_parallel_layout: Optional[str] = None
    """Every stage's layers (--pipeline-model-parallel-layout, Megatron-LM's grammar:
    "Ett|tL"; megatron/pipeline/layout.py); its PP x VP stages set the virtual stages."""
    decoder_first_pipeline_num_layers: Optional[int] = None
    """Transformer layers of the first pipeline rank; the others split the rest evenly."""
    decoder_last_pipeline_num_layers: Optional[int] = None
    """Transformer layers of the last pipeline rank; the others split the rest evenly."""
    context_parallel_size: int = 1
    """Ranks that split each sequence (--context-parallel-size): 2·CP load-balanced chunks."""
    cp_comm_type: str = "p2p"
    """Attention across CP ranks (--cp-comm-type): p2p (ring of K/V blocks, merged by their
    log-sum-exp) | a2a (all-to-all over heads, DeepSpeed-Ulysses)."""
    sequence_parallel: bool = False
    """Split layer norms and dropout along the sequence over the TP group."""
    expert_model_parallel_size: int = 1
    """Ranks that split the experts of each MoE layer, carved out of data parallelism."""
    expert_tensor_parallel_size: Optional[int] = None
    """Ranks that split each expert (default: --tensor-model-parallel-size); a divisor of TP.
    Below TP the experts spread over ETP x EP ranks and the TP ranks split their tokens."""
    distributed_backend: Optional[str] = None
    """nccl | gloo; None picks nccl when CUDA is available, else gloo."""
    DDP_impl: str = "local"
    """local (our bucketed all-reduce) | torch (DistributedDataParallel)."""
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    ddp_bucket_size: int = 40_000_000
    """Elements per gradient bucket of --DDP-impl local (--ddp-bucket-size)."""
    accumulate_allreduce_grads_in_fp32: bool = False
    use_torch_fsdp2: bool = False
    """Shard parameters, gradients and optimizer state over DP x CP (MoE experts over
    expert-DP) with torch's FSDP2 (--use-torch-fsdp2; megatron/distributed/fsdp.py)."""
    fsdp_reshard_after_forward: bool = True
    """Free each FSDP unit's gathered parameters after its forward and gather them again for
    its backward (ZeRO-3-like; Megatron-Core's default), or keep them to the backward and
    from one micro batch to the next (--no-fsdp-reshard-after-forward, ZeRO-2-like)."""
    distributed_timeout_minutes: float = 10.0
    """Timeout of every collective; a silent peer ends the run with one line."""

    def __post_init__(self):
        require(self.tensor_model_parallel_size >= 1,
                f"--tensor-model-parallel-size must be >= 1, got {self.tensor_model_parallel_size}")
        require(self.pipeline_model_parallel_size >= 1,
                f"--pipeline-model-parallel-size must be >= 1, got {self.pipeline_model_parallel_size}")
        require(self.context_parallel_size >= 1,
                f"--context-parallel-size must be >= 1, got {self.context_parallel_size}")
        require(self.cp_comm_type in ("p2p", "a2a"),
                f"--cp-comm-type {self.cp_comm_type!r} is not p2p or a2a")
        require(self.expert_model_parallel_size >= 1,
                f"--expert-model-parallel-size must be >= 1, got {self.expert_model_parallel_size}")
        etp = self.expert_tensor_parallel_size  # None: TP (kept None, so re-sharding TP keeps it)
        require(etp is None or etp >= 1, f"--expert-tensor-parallel-size must be >= 1, got {etp}")
        require(self.distributed_backend in (None, "nccl", "gloo"),
                f"--distributed-backend {self.distributed_backend!r} is not nccl or gloo")
        require(self.DDP_impl in ("local", "torch"), f"--DDP-impl {self.DDP_impl!r} is not local or torch")
        require(self.ddp_bucket_size >= 1,
                f"--ddp-bucket-size must be a positive number of elements, got {self.ddp_bucket_size}")
        require(self.distributed_timeout_minutes > 0,
                f"--distributed-timeout-minutes must be positive, got {self.distributed_timeout_minutes}")
        self._check_reducer_options()
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            self.sequence_parallel = False  # nothing to split, as in Megatron

    def _check_reducer_options(self):
        """Combinations of the gradient reducer and optimizer that are not supported."""
        pp = self.pipeline_model_parallel_size
        require(not (self.DDP_impl == "torch" and pp > 1),
                f"--DDP-impl torch supports --pipeline-model-parallel-size 1 only (got {pp}); "
                f"use --DDP-impl local")
        require(not (self.DDP_impl == "torch" and self.use_distributed_optimizer),
                "--use-distributed-optimizer needs --DDP-impl local (its gradient buffer is what "
                "the optimizer shards); drop --DDP-impl torch")

    @property
    def expert_tp(self) -> int:
        """The expert TP size (--expert-tensor-parallel-size, default TP)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def model_parallel_size(self) -> int:
        """Ranks per copy of the data stream: TP x CP x PP."""
        return (self.tensor_model_parallel_size * self.context_parallel_size
                * self.pipeline_model_parallel_size)
