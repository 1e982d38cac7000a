"""Data-parallel gradient reduction: our bucketed reducer, or torch's DDP.

`GradReducer` (--DDP-impl local): every parameter gets a `main_grad` view into
one contiguous buffer (fp32 for 16-bit models, so micro-batch gradients
accumulate in full precision). A hook moves each freshly computed `.grad` into
`main_grad` (layers that add their weight gradient to `main_grad` themselves, the
GPT head, leave `.grad` None; the hook still marks the parameter done). Buckets
are laid out in reverse parameter order, the order in which backward produces
gradients; with `overlap_grad_reduce` each bucket's
reduction starts as soon as its last gradient of the last micro batch is in,
overlapping with the rest of backward. Buckets holding a parameter passed as
`held` wait for `finish_grad_sync` instead: the tied word embeddings under the
distributed optimizer, whose copies on the first and last stage must be summed
before the reduce-scatter (the two stages shard them at different offsets).

The reducer's group is the one its gradients are summed over: DP x CP for dense
parameters (one reduction, as Megatron-Core's; DP alone without context parallelism),
expert-DP for MoE experts. "DP" below means that group.

With `reduce_scatter` (the distributed optimizer) each bucket is padded to a
multiple of the DP size and split into DP equal contiguous shards; a DP rank
only needs the averaged gradient of its own shard of every bucket:
reduce-scatter on NCCL, all-reduce (then read the slice) on gloo.

`TorchDDPReducer` (--DDP-impl torch) wraps a model chunk in
torch.nn.parallel.DistributedDataParallel; gradients stay in `.grad`.
"""
import contextlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.fused.elementwise import add_to_float_
from megatron.mpu.mappings import group_rank, group_size

SHARD_ALIGNMENT = 128
"""Elements each DP shard of a bucket is padded to a multiple of (512-byte aligned in fp32)."""


def plan_buckets(sizes: List[int], bucket_size: int, pad_to: int = 1
                 ) -> Tuple[List[int], List[Tuple[int, int, int]]]:
    """Lay out tensors of `sizes` back to back in buckets of about `bucket_size` elements.

    Returns (offset of each tensor, buckets as (start, end, number of tensors)).
    A bucket closes once it holds `bucket_size` elements; its end is padded up to
    a multiple of `pad_to` (the next bucket starts there).
    """
    offsets, buckets = [], []
    start, offset, count = 0, 0, 0
    for size in sizes:
        offsets.append(offset)
        offset += size
        count += 1
        if offset - start >= bucket_size:
            offset = _round_up(offset, pad_to)
            buckets.append((start, offset, count))
            start, count = offset, 0
    if count:
        offset = _round_up(offset, pad_to)
        buckets.append((start, offset, count))
    return offsets, buckets


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def shard_range(start: int, end: int, dp_size: int, dp_rank: int) -> Tuple[int, int]:
    """The contiguous [start, end) slice of bucket [start, end) owned by `dp_rank`."""
    size = (end - start) // dp_size
    return start + dp_rank * size, start + (dp_rank + 1) * size


class _Bucket:
    def __init__(self, params: List[torch.nn.Parameter], data: torch.Tensor, start: int,
                 shard: Tuple[int, int]):
        self.params = params
        self.data = data
        self.start = start
        """Offset of the bucket in the reducer's buffer."""
        self.shard = shard
        """[start, end) in the buffer of this DP rank's shard (the whole bucket unsharded)."""
        self.held = False
        """Not started during backward, only by finish_grad_sync."""
        self.scaled = False
        """Divided by the reducer's divisor in this step."""
        self.pending = set(params)
        self.handle = None

    def shard_view(self) -> torch.Tensor:
        return self.data[self.shard[0] - self.start:self.shard[1] - self.start]

    def reset(self):
        self.pending = set(self.params)
        self.handle = None
        self.scaled = False


class GradReducer:
    """Owns the gradient buffer of a model's parameters and its DP reduction."""

    def __init__(self, params: List[torch.nn.Parameter], dp_group, grad_dtype: torch.dtype,
                 bucket_size: int = 40_000_000, overlap: bool = False,
                 reduce_scatter: bool = False, held: Sequence[torch.nn.Parameter] = (),
                 divisor: Optional[int] = None, experts: bool = False):
        """`divisor`: what the summed gradients are divided by (default the group size):
        the DP size, for dense gradients summed over DP x CP and expert gradients summed
        over their expert-DP group (`experts`: this reducer holds them)."""
        self.dp_group = dp_group
        self.dp_size = group_size(dp_group)
        self.dp_rank = group_rank(dp_group)
        self.divisor = divisor or self.dp_size
        self.experts = experts
        self.overlap = overlap and self.dp_size > 1
        self.reduce_scatter = reduce_scatter
        self.sync_enabled = True
        params = [p for p in params if p.requires_grad]
        ordered = list(reversed(params))
        pad = self.dp_size * SHARD_ALIGNMENT if reduce_scatter else 1
        offsets, spans = plan_buckets([p.numel() for p in ordered], bucket_size, pad)
        device = params[0].device if params else None
        numel = spans[-1][1] if spans else 0
        self.buffer = torch.zeros(numel, dtype=grad_dtype, device=device)
        self.offsets: Dict[torch.nn.Parameter, int] = {}
        for p, offset in zip(ordered, offsets):
            p.main_grad = self.buffer[offset:offset + p.numel()].view_as(p)
            self.offsets[p] = offset
        self.buckets = self._make_buckets(ordered, spans)
        self._bucket_of: Dict[torch.nn.Parameter, _Bucket] = {
            p: b for b in self.buckets for p in b.params}
        for p in held:
            if p in self._bucket_of:
                self._bucket_of[p].held = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _make_buckets(self, ordered, spans) -> List[_Bucket]:
        buckets, first = [], 0
        for start, end, count in spans:
            shard = (shard_range(start, end, self.dp_size, self.dp_rank) if self.reduce_scatter
                     else (start, end))
            params = ordered[first:first + count]
            buckets.append(_Bucket(params, self.buffer[start:end], start, shard))
            first += count
        return buckets

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if param.grad is not None:  # None: the layer added its gradient to main_grad itself
            add_to_float_(param.main_grad, param.grad)  # bf16 grads widened as they are added
            param.grad = None
        if not (self.overlap and self.sync_enabled):
            return
        bucket = self._bucket_of[param]
        if param not in bucket.pending:
            raise RuntimeError("a parameter received two gradients in one backward after its "
                               "bucket was reduced; run without --overlap-grad-reduce")
        bucket.pending.discard(param)
        if not bucket.pending and not bucket.held:
            self._start(bucket)

    def _start(self, bucket: _Bucket) -> None:
        if bucket.scaled:
            return
        bucket.scaled = True
        if self.divisor != 1:
            bucket.data.div_(self.divisor)
        if self.dp_size == 1:
            return
        if self.reduce_scatter and dist.get_backend(self.dp_group) == "nccl":
            # In place: the output is this rank's slice of the input.
            bucket.handle = dist.reduce_scatter_tensor(bucket.shard_view(), bucket.data,
                                                       group=self.dp_group, async_op=True)
        else:  # gloo has no reduce-scatter: all-reduce, the shard is then a slice
            bucket.handle = dist.all_reduce(bucket.data, group=self.dp_group, async_op=True)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without reducing them (all but the last micro batch)."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous

    def finish_grad_sync(self) -> None:
        """Average gradients over DP (each rank's shard of them with `reduce_scatter`):
        start what has not started, wait for all."""
        for bucket in self.buckets:
            self._start(bucket)
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            bucket.reset()

    def zero_grad(self) -> None:
        self.buffer.zero_()
        for bucket in self.buckets:
            bucket.reset()


def _sum_then_divide_hook(divisor: int, group):
    """A DDP communication hook: each bucket summed over `group` and divided by `divisor`
    (DDP's own divides by the group's size)."""
    def hook(_state, bucket):
        buffer = bucket.buffer().div_(divisor)
        work = dist.all_reduce(buffer, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    return hook


class TorchDDPReducer:
    """--DDP-impl torch: DistributedDataParallel reduces `.grad` over DP x CP, divided
    by the DP size (as the local reducer: each CP rank's gradient is its part of the
    sequence's, summed over CP).

    The model itself stays unwrapped for everything else (checkpoint keys,
    `set_input_tensor`); only the forward goes through `module_for_forward()`.
    DDP decides during the forward whether the coming backward all-reduces, so
    the reducer counts forwards and lets only the last micro batch synchronise.
    """

    def __init__(self, module: torch.nn.Module, group, divisor: int):
        from torch.nn.parallel import DistributedDataParallel
        self.module = module
        self.ddp: Optional[torch.nn.Module] = None
        if group_size(group) > 1:
            self.ddp = DistributedDataParallel(module, process_group=group)
            if divisor != group_size(group):
                self.ddp.register_comm_hook(None, _sum_then_divide_hook(divisor, group))
        self.num_micro_batches = 1
        self._forwards = 0

    def begin_step(self, num_micro_batches: int) -> None:
        """Called before the forwards and backwards of one global batch."""
        self.num_micro_batches = num_micro_batches
        self._forwards = 0

    def module_for_forward(self) -> torch.nn.Module:
        if self.ddp is None:
            return self.module
        self._forwards += 1
        self.ddp.require_backward_grad_sync = self._forwards >= self.num_micro_batches
        return self.ddp

    def no_sync(self):
        return contextlib.nullcontext()  # decided in module_for_forward()

    def finish_grad_sync(self) -> None:
        pass  # DDP waits for its all-reduces at the end of backward

    def zero_grad(self) -> None:
        for p in self.module.parameters():
            p.grad = None


def build_grad_reducers(models: List[torch.nn.Module], pstate, parallel_cfg,
                        grad_dtype: torch.dtype,
                        tied_params: Sequence[torch.nn.Parameter] = ()) -> list:
    """One reducer per model chunk, of the kind --DDP-impl asks for, and one more per
    chunk with MoE experts. Dense gradients are reduced once over DP x CP (Megatron-Core's
    data-parallel group with context parallelism: each CP rank's gradient is its chunks'
    part of the sequence's), expert gradients over expert-DP (the same ranks re-divided by
    EP), both divided by the DP size. `tied_params`: parameters whose gradients are summed
    with another stage's after backward."""
    if parallel_cfg.DDP_impl == "torch":
        return [TorchDDPReducer(m, pstate.dp_cp_group, pstate.dp_size) for m in models]
    sharded = parallel_cfg.use_distributed_optimizer
    common = dict(bucket_size=parallel_cfg.ddp_bucket_size,
                  overlap=parallel_cfg.overlap_grad_reduce, reduce_scatter=sharded,
                  divisor=pstate.dp_size)
    reducers = []
    for m in models:
        params = list(m.parameters())
        experts = [p for p in params if getattr(p, "expert_parallel", False)]
        dense = [p for p in params if not getattr(p, "expert_parallel", False)]
        reducers.append(GradReducer(dense, pstate.dp_cp_group, grad_dtype,
                                    held=tied_params if sharded else (), **common))
        if experts:
            reducers.append(GradReducer(experts, pstate.edp_group, grad_dtype, experts=True,
                                        **common))
    return reducers
