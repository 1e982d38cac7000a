"""Autograd-aware collectives of tensor and sequence parallelism.

Each public function takes the tensor-parallel group explicitly; a None group or
a group of one process makes it the identity. The forward of each Function is
the backward of its partner:

    copy_to      fwd identity     bwd all-reduce
    reduce_from  fwd all-reduce   bwd identity
    scatter_to   fwd split last   bwd gather last
    gather_from  fwd gather last  bwd split last
    scatter_to_sequence         fwd split first       bwd gather first
    gather_from_sequence        fwd gather first      bwd reduce-scatter first
    reduce_scatter_to_sequence  fwd reduce-scatter    bwd gather first
    linear_with_sequence_gather fwd gather first, then the linear; bwd gather first again
                                (only the input's shard is saved), reduce-scatter first
    sum_replica_grads           fwd identity          bwd sum the trailing rows over
                                                      the ranks of the same replica set

COLLECTIVE_WAIT counts the seconds spent inside these collectives (blocking on CPUs over
gloo): --log-straggler subtracts them from a rank's compute time.
"""
import functools
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


class WaitClock:
    """Seconds spent inside the collectives of this module, accumulated by this process."""

    def __init__(self):
        self.seconds = 0.0

    def timed(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return wrapper


COLLECTIVE_WAIT = WaitClock()


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _is_nccl(group) -> bool:
    return dist.get_backend(group) == "nccl"


@COLLECTIVE_WAIT.timed
def all_reduce(x, group, op=dist.ReduceOp.SUM):
    """In-place all-reduce of `x` over `group` (no-op for one process)."""
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _split(x, dim, group):
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size != 0:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by "
                         f"the tensor-parallel size {size}")
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


@COLLECTIVE_WAIT.timed
def _gather(x, dim, group):
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    if _is_nccl(group) and dim == 0:
        out = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


@COLLECTIVE_WAIT.timed
def _reduce_scatter(x, dim, group):
    """Sum over the group, keep this rank's slice of `dim` (first dimension)."""
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size != 0:
        raise ValueError(f"sequence length {x.shape[dim]} is not divisible by the "
                         f"tensor-parallel size {size} (sequence parallelism)")
    if _is_nccl(group) and dim == 0:
        out = torch.empty((x.shape[0] // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out
    # gloo has no reduce-scatter: all-reduce then keep our slice.
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.clone(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, grad.dim() - 1, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, grad.dim() - 1, ctx.group), None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, 0, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_grad_is_partial):
        ctx.group = group
        ctx.output_grad_is_partial = output_grad_is_partial
        return _gather(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.output_grad_is_partial:
            return _reduce_scatter(grad, 0, ctx.group), None, None
        return _split(grad, 0, ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, 0, ctx.group), None


class _LinearWithSequenceGather(torch.autograd.Function):
    """F.linear(all-gather(x), weight, bias), saving x's sequence shard rather than the
    gathered input: the backward gathers it again (as Megatron's sequence-parallel
    linear does), so a column-parallel layer keeps s b h / t of its input, not s b h."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_gather(x, 0, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        needs_x, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_x = grad_weight = grad_bias = None
        if needs_x:  # each rank's gradient is a partial sum over its columns
            grad_x = _reduce_scatter(grad.matmul(weight), 0, ctx.group)
        flat = grad.reshape(-1, grad.shape[-1])
        if needs_weight:
            total = _gather(x, 0, ctx.group)
            grad_weight = flat.t().matmul(total.reshape(-1, total.shape[-1]))
        if needs_bias and ctx.has_bias:
            grad_bias = flat.sum(0)
        return grad_x, grad_weight, grad_bias, None


def linear_with_sequence_gather(x, weight, bias, group):
    """The linear of a column-parallel layer whose input is split along the sequence
    (first) dimension over `group`: see _LinearWithSequenceGather."""
    if group_size(group) == 1:
        return F.linear(x, weight, bias)
    return _LinearWithSequenceGather.apply(x, weight, bias, group)


def copy_to_tensor_model_parallel_region(x, group):
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x, group):
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x, group):
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x, group):
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x, group):
    return x if group_size(group) == 1 else _ScatterToSequence.apply(x, group)


def gather_from_sequence_parallel_region(x, group, output_grad_is_partial=True):
    """All-gather the sequence dimension. When the consumer is a tensor-parallel
    layer, each rank's output gradient is a partial sum and the backward is a
    reduce-scatter; otherwise it is a plain split."""
    if group_size(group) == 1:
        return x
    return _GatherFromSequence.apply(x, group, output_grad_is_partial)


def reduce_scatter_to_sequence_parallel_region(x, group):
    return x if group_size(group) == 1 else _ReduceScatterToSequence.apply(x, group)


class _SumReplicaGrads(torch.autograd.Function):
    """Identity; backward sums the last `rows` rows of the gradient over the TP ranks
    that hold the same replica (rank r is in set r // per_set), by an all-reduce of a
    zero buffer with one slot per set."""

    @staticmethod
    def forward(ctx, x, rows, per_set, group):
        ctx.rows, ctx.per_set, ctx.group = rows, per_set, group
        return x

    @staticmethod
    def backward(ctx, grad):
        rows, per_set = ctx.rows, ctx.per_set
        sets = group_size(ctx.group) // per_set
        mine = group_rank(ctx.group) // per_set
        slots = grad.new_zeros((sets, rows) + tuple(grad.shape[1:]))
        slots[mine] = grad[-rows:]
        all_reduce(slots, ctx.group)
        grad = grad.clone()
        grad[-rows:] = slots[mine]
        return grad, None, None, None


def sum_replica_grads(x, rows: int, per_set: int, group):
    """Weights whose last `rows` rows are replicated on each `per_set` consecutive TP
    ranks (k / v of a query group when TP exceeds the groups): their gradient is the
    sum over the set, so the replicas stay equal."""
    if per_set == 1 or group_size(group) == 1:
        return x
    return _SumReplicaGrads.apply(x, rows, per_set, group)


class _AllToAll(torch.autograd.Function):
    """Rows of `x` split by `send` go to the group's ranks; `recv` rows come from each.
    Backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, group, send, recv):
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return _all_to_all(x, group, send, recv)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.recv, ctx.send), None, None, None


@COLLECTIVE_WAIT.timed
def _all_to_all(x, group, send, recv):
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(recv),
                           input_split_sizes=list(send), group=group)
    return out


def all_to_all(x, group, send, recv):
    """All-to-all of rows (expert parallelism): `send[r]` rows of `x` go to rank r,
    `recv[r]` rows arrive from it (lists of ints; gloo takes no tensor sizes)."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, list(send), list(recv))
