"""Data-parallel gradient reduction over contiguous buckets.

Every parameter gets a `main_grad` view into one contiguous buffer (fp32 for
16-bit models, so micro-batch gradients accumulate in full precision). A hook
moves each freshly computed `.grad` into `main_grad`. Buckets are laid out in
reverse parameter order, the order in which backward produces gradients; with
`overlap_grad_reduce` each bucket's all-reduce starts as soon as its last
gradient of the last micro batch is in, overlapping with the rest of backward.
"""
import contextlib
from typing import Dict, List

import torch
import torch.distributed as dist

from megatron.mpu.mappings import group_size


class _Bucket:
    def __init__(self, params: List[torch.nn.Parameter], data: torch.Tensor):
        self.params = params
        self.data = data
        self.pending = set(params)
        self.handle = None

    def reset(self):
        self.pending = set(self.params)
        self.handle = None


class GradReducer:
    """Owns the gradient buffer of a model's parameters and its DP all-reduce."""

    def __init__(self, params: List[torch.nn.Parameter], dp_group, grad_dtype: torch.dtype,
                 bucket_size: int = 40_000_000, overlap: bool = False):
        self.dp_group = dp_group
        self.dp_size = group_size(dp_group)
        self.overlap = overlap and self.dp_size > 1
        self.sync_enabled = True
        params = [p for p in params if p.requires_grad]
        numel = sum(p.numel() for p in params)
        device = params[0].device if params else None
        self.buffer = torch.zeros(numel, dtype=grad_dtype, device=device)
        self.buckets = self._make_buckets(list(reversed(params)), bucket_size)
        self._bucket_of: Dict[torch.nn.Parameter, _Bucket] = {
            p: b for b in self.buckets for p in b.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _make_buckets(self, params, bucket_size) -> List[_Bucket]:
        buckets, current, start, offset = [], [], 0, 0
        for p in params:
            p.main_grad = self.buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            current.append(p)
            if offset - start >= bucket_size:
                buckets.append(_Bucket(current, self.buffer[start:offset]))
                current, start = [], offset
        if current:
            buckets.append(_Bucket(current, self.buffer[start:offset]))
        return buckets

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        param.main_grad.add_(param.grad)
        param.grad = None
        if not (self.overlap and self.sync_enabled):
            return
        bucket = self._bucket_of[param]
        if param not in bucket.pending:
            raise RuntimeError("a parameter received two gradients in one backward after its "
                               "bucket was reduced; run without --overlap-grad-reduce")
        bucket.pending.discard(param)
        if not bucket.pending:
            self._start(bucket)

    def _start(self, bucket: _Bucket) -> None:
        if self.dp_size == 1 or bucket.handle is not None:
            return
        bucket.data.div_(self.dp_size)
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
        """Average gradients over DP: start what has not started, wait for all."""
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
