"""Tensor-parallel layers: each holds 1/TP of its weight.

Parameters are created empty and carry what the rest of the framework needs:
`tensor_model_parallel`, `partition_dim`, `partition_stride` (the checkpoint
merge tool and gradient clipping read them) and `init_method`, used by
`init_parameters`, which fills every parameter from a seed derived from its
global name. With `use_cpu_initialization` every rank builds the full weight
from the same seed and keeps its slice, so any TP or PP layout starts from the
model that TP = PP = 1 starts from.
"""
import math
import zlib
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F

from megatron.mpu.mappings import (
    copy_to_tensor_model_parallel_region, gather_from_tensor_model_parallel_region, group_rank,
    group_size, linear_with_sequence_gather,
    reduce_from_tensor_model_parallel_region, reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region)
from megatron.mpu.random import _MODEL_PARALLEL_SEED_OFFSET
from megatron.mpu.sharding import full_shape, parameter_meta, shard_tensor


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def init_normal(std: float) -> Callable:
    def init_(tensor, generator=None):
        return torch.nn.init.normal_(tensor, mean=0.0, std=std, generator=generator)
    return init_


def scaled_init_normal(std: float, num_layers: int) -> Callable:
    """Init of output projections: std / sqrt(2 * num_layers)."""
    return init_normal(std / math.sqrt(2.0 * num_layers))


def _zeros(tensor, generator=None):
    return tensor.zero_()


def _ones(tensor, generator=None):
    return tensor.fill_(1.0)


def set_parallel_attributes(param, is_parallel: bool, dim: int = -1, stride: int = 1,
                            init_method: Optional[Callable] = None):
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride
    if init_method is not None:
        param.init_method = init_method


def _new_param(shape, device, dtype):
    return torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype))


def _init_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63)


def shard_of(full: torch.Tensor, dim: int, stride: int, rank: int, size: int) -> torch.Tensor:
    """This rank's slice of a full weight along `dim`, interleaved by `stride`."""
    chunk = divide(full.shape[dim], size * stride)
    pieces = torch.split(full, chunk, dim=dim)
    return torch.cat(pieces[rank::size], dim=dim)


@torch.no_grad()
def init_parameters(named_params: Dict[str, torch.nn.Parameter], seed: int, tp_group,
                    use_cpu_initialization: bool) -> None:
    """Fill each parameter from a generator seeded by `seed` and its global name.

    Sharded parameters either get their slice of the full weight
    (`use_cpu_initialization`, identical across TP sizes; sliced by the
    parameter's sharding metadata, megatron.mpu.sharding) or are initialised
    directly with the model-parallel seed (seed + 2718 + tp_rank), which needs no
    full weight in memory.
    """
    for name, param in named_params.items():
        group = getattr(param, "tensor_parallel_group", tp_group)  # experts: expert TP
        rank, size = group_rank(group), group_size(group)
        init = getattr(param, "init_method", _zeros)
        sharded = getattr(param, "tensor_model_parallel", False) and size > 1
        meta = parameter_meta(param)
        # k / v replicas (TP > query groups) must start equal: slice them from the full weight
        replicas = size > meta.get("query_groups", size)
        if not sharded or use_cpu_initialization or replicas:
            gen = torch.Generator().manual_seed(_init_seed(seed, name))
            full = init(torch.empty(full_shape(param.shape, meta, size), dtype=torch.float32), gen)
            param.copy_(shard_tensor(full, meta, rank, size) if sharded else full)
        else:
            gen = torch.Generator(device=param.device).manual_seed(
                _init_seed(seed + _MODEL_PARALLEL_SEED_OFFSET + rank, name))
            tmp = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            param.copy_(init(tmp, gen))


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding whose vocabulary rows are split across the TP group."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group=None,
                 init_method: Callable = init_normal(0.02), device=None, dtype=torch.float32):
        super().__init__()
        self.tp_group = tp_group
        per_partition = divide(num_embeddings, group_size(tp_group))
        self.vocab_start = group_rank(tp_group) * per_partition
        self.vocab_end = self.vocab_start + per_partition
        self.weight = _new_param((per_partition, embedding_dim), device, dtype)
        set_parallel_attributes(self.weight, True, 0, 1, init_method)

    def forward(self, ids):
        if group_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(out, self.tp_group)


class ColumnParallelLinear(torch.nn.Module):
    """Y = X A + b with A split by columns: each rank computes Y_i = X A_i + b_i.

    gather_output: all-gather Y along the last dimension (else Y stays split).
    sequence_parallel: X arrives split along the sequence (first) dimension and
    is all-gathered first. skip_bias_add: return (Y, b) for a later fused add.
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group=None, bias: bool = True,
                 gather_output: bool = False, init_method: Callable = init_normal(0.02),
                 stride: int = 1, skip_bias_add: bool = False, sequence_parallel: bool = False,
                 device=None, dtype=torch.float32):
        super().__init__()
        self.tp_group = tp_group
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel and group_size(tp_group) > 1
        out_per_partition = divide(output_size, group_size(tp_group))
        self.weight = _new_param((out_per_partition, input_size), device, dtype)
        set_parallel_attributes(self.weight, True, 0, stride, init_method)
        self.bias = None
        if bias:
            self.bias = _new_param((out_per_partition,), device, dtype)
            set_parallel_attributes(self.bias, True, 0, stride, _zeros)

    def forward(self, x):
        bias = None if self.skip_bias_add else self.bias
        if self.sequence_parallel:  # saves only x's shard, gathered again in the backward
            y = linear_with_sequence_gather(x, self.weight, bias, self.tp_group)
        else:
            y = F.linear(copy_to_tensor_model_parallel_region(x, self.tp_group), self.weight, bias)
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.tp_group)
        return (y, self.bias) if self.skip_bias_add else y


class RowParallelLinear(torch.nn.Module):
    """Y = X A + b with A split by rows: Y = sum_i X_i A_i + b.

    input_is_parallel: X is already split along its last dimension (the output of
    a ColumnParallelLinear); otherwise it is split here. The partial products are
    all-reduced, or reduce-scattered along the sequence under sequence
    parallelism. The bias is replicated and added after the reduction.
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group=None, bias: bool = True,
                 input_is_parallel: bool = False, init_method: Callable = init_normal(0.02),
                 stride: int = 1, skip_bias_add: bool = False, sequence_parallel: bool = False,
                 device=None, dtype=torch.float32):
        super().__init__()
        self.tp_group = tp_group
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel and group_size(tp_group) > 1
        in_per_partition = divide(input_size, group_size(tp_group))
        self.weight = _new_param((output_size, in_per_partition), device, dtype)
        set_parallel_attributes(self.weight, True, 1, stride, init_method)
        self.bias = None
        if bias:
            self.bias = _new_param((output_size,), device, dtype)
            set_parallel_attributes(self.bias, False, init_method=_zeros)
            self.bias.sequence_parallel = self.sequence_parallel

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = reduce_from_tensor_model_parallel_region(y, self.tp_group)
        if self.skip_bias_add:
            return y, self.bias
        return y + self.bias if self.bias is not None else y


def layer_norm_init_attributes(norm: torch.nn.Module) -> None:
    """Give a LayerNorm's (or RMSNorm's: no bias) parameters the attributes `init_parameters` reads."""
    set_parallel_attributes(norm.weight, False, init_method=_ones)
    if getattr(norm, "bias", None) is not None:
        set_parallel_attributes(norm.bias, False, init_method=_zeros)


def main_grad_of(weight: torch.Tensor, widening: bool = False) -> Optional[torch.Tensor]:
    """The data-parallel reducer's gradient buffer of `weight` when a layer's backward can
    add the weight gradient there directly (same dtype; the GPT head, the grouped expert
    GEMM): no weight-sized tensor is made, and the autograd gradient is None. `widening`:
    also a 16-bit weight's float32 buffer, for a layer that adds its 16-bit product with
    `add_to_float_` (the GPT head). A tied weight's other use (the input embedding) still
    arrives through autograd and the reducer's hook, so the two are summed in float32."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None or not weight.requires_grad:
        return None
    if main_grad.dtype != weight.dtype and not (widening and main_grad.dtype == torch.float32):
        return None
    return main_grad
