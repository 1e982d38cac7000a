"""Model parallel utilities: process groups, parallel layers, cross entropy, RNG."""
from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy
from megatron.mpu.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                 init_parameters)
from megatron.mpu.mappings import (
    copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region)
from megatron.mpu.parallel_state import (ParallelState, initialize_model_parallel,
                                         single_process_state)
from megatron.mpu.random import checkpoint, get_rng_tracker, model_parallel_seed
from megatron.mpu.topology import ParallelDims

__all__ = [
    "vocab_parallel_cross_entropy", "ColumnParallelLinear", "RowParallelLinear",
    "VocabParallelEmbedding", "init_parameters", "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region", "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region", "scatter_to_tensor_model_parallel_region",
    "ParallelState", "initialize_model_parallel", "single_process_state",
    "checkpoint", "get_rng_tracker", "model_parallel_seed", "ParallelDims",
]
