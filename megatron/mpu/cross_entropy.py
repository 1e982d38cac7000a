"""Cross entropy over logits whose vocabulary is split across tensor-parallel ranks.

The full logits are never gathered: each rank holds [..., V / TP]; the max and
the sum of exponentials are all-reduced over the group, and so is the logit of
the target, which lives on exactly one rank.

The work happens in place on one logits-sized buffer: the forward turns it
into exp(logit - max) (the softmax up to its row sums) and the backward turns
that into the gradient. No other logits-sized tensor is ever made; the logits
are by far the largest activation of a GPT. bfloat16 logits on CPUs with the
kernels (`_forward_grad_`) keep the float32 softmax in registers only: the
forward turns the bfloat16 logits themselves into softmax - one_hot(target),
rounded once, and the backward scales by each row's loss gradient after the
products (on the hidden states and the input gradient, [N, h]) instead of
making a float32 copy of the logits and passing over it three more times.

`linear_cross_entropy` is the head of the GPT: the output-layer matmul and the
loss in one autograd function, so that the logits buffer, too, is the function's
own. On CPUs it comes from a `LogitsBuffers` pool and is reused from step to
step: there is no caching allocator there, and every fresh logits-sized tensor
costs its size in page faults (~20 ms for 64 MiB on two cores).
"""
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron import fused
from megatron.mpu.layers import main_grad_of
from megatron.mpu.mappings import all_reduce, group_rank, group_size


def vocab_range(per_partition: int, rank: int):
    """[first, last) vocabulary ids held by `rank`."""
    first = rank * per_partition
    return first, first + per_partition


class _State:
    """What the backward of `_forward_` needs besides the buffer."""

    def __init__(self, sum_exp, local_target, on_rank, label_smoothing, vocab_size):
        self.sum_exp = sum_exp
        self.local_target = local_target
        self.on_rank = on_rank
        self.label_smoothing = label_smoothing
        self.vocab_size = vocab_size


def _local_targets(logits: torch.Tensor, target: torch.Tensor, group):
    """(on this rank [N], the target's column in this shard (0 where elsewhere) [N], its
    float logit [N]) for logits [N, V / TP] and global target ids [N]."""
    first, last = vocab_range(logits.shape[-1], group_rank(group))
    on_rank = (target >= first) & (target < last)
    local_target = (target - first).masked_fill(~on_rank, 0)
    return on_rank, local_target, logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float()


def _forward_(buf: torch.Tensor, target: torch.Tensor, group, label_smoothing: float
              ) -> Tuple[torch.Tensor, _State]:
    """Per-row float losses [N] of logits `buf` [N, V / TP] (overwritten with
    exp(logit - max)) and targets [N] (global vocabulary ids)."""
    vocab_size = buf.shape[-1] * group_size(group)
    on_rank, local_target, target_logit = _local_targets(buf, target, group)
    logit_sum = buf.sum(dim=-1, dtype=torch.float32) if label_smoothing > 0 else None
    row_max = None
    if group_size(group) > 1:
        row_max = all_reduce(buf.amax(dim=-1).float(), group, op=dist.ReduceOp.MAX)
    row_max, sum_exp = fused.exp_sum_(buf, row_max)
    sum_exp = all_reduce(sum_exp, group)
    target_logit = all_reduce((target_logit - row_max).masked_fill_(~on_rank, 0.0), group)
    log_sum_exp = sum_exp.log()
    loss = log_sum_exp - target_logit
    if label_smoothing > 0:
        # (1 - eps) * nll + eps * mean over the vocabulary of -log p.
        shifted_sum = all_reduce(logit_sum - buf.shape[-1] * row_max, group)
        log_probs_sum = shifted_sum - vocab_size * log_sum_exp
        loss = (1.0 - label_smoothing) * loss - label_smoothing * log_probs_sum / vocab_size
    return loss, _State(sum_exp, local_target, on_rank, label_smoothing, vocab_size)


def _backward_(buf: torch.Tensor, state: _State, grad_loss: torch.Tensor) -> torch.Tensor:
    """buf (exp(logit - max) from `_forward_`) <- d loss / d logits, given d out / d loss [N]."""
    grad_loss = grad_loss.float()
    eps = state.label_smoothing
    buf.mul_((grad_loss / state.sum_exp).unsqueeze(-1))  # softmax * grad
    picked = (-(1.0 - eps) * grad_loss).masked_fill_(~state.on_rank, 0.0)
    buf.scatter_add_(-1, state.local_target.unsqueeze(-1), picked.unsqueeze(-1).to(buf.dtype))
    if eps > 0:
        buf.sub_((eps / state.vocab_size * grad_loss).unsqueeze(-1))
    return buf


def _forward_grad_(logits: torch.Tensor, target: torch.Tensor, group, for_backward: bool
                   ) -> torch.Tensor:
    """Per-row float losses [N] of bfloat16 logits [N, V / TP] (`fused.softmax_grad_fusable`)
    and targets [N], the softmax in float32 as `_forward_` takes it but never kept: for_backward
    the logits become softmax - one_hot(target) in place, rounded to bfloat16 once, which is
    d loss / d logits up to each row's loss gradient (the backward scales by it). On one
    rank that is one pass per row; across tensor-parallel ranks a first pass finds each
    shard's row max and sum of exponentials, which are merged before the second."""
    on_rank, local_target, target_logit = _local_targets(logits, target, group)
    shard_target = local_target.masked_fill(~on_rank, -1)
    if group_size(group) == 1 and for_backward:  # one pass
        row_max, sum_exp = fused.softmax_minus_target_(logits, shard_target)
    else:
        row_max, sum_exp = fused.max_exp_sum(logits)
        if group_size(group) > 1:  # merge the shards' (max, sum) pairs
            local_max = row_max
            row_max = all_reduce(local_max.clone(), group, op=dist.ReduceOp.MAX)
            sum_exp = all_reduce(sum_exp * torch.exp(local_max - row_max), group)
        if for_backward:
            fused.softmax_minus_target_(logits, shard_target, row_max, sum_exp)
    target_logit = all_reduce((target_logit - row_max).masked_fill_(~on_rank, 0.0), group)
    return sum_exp.log() - target_logit


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, label_smoothing=0.0):
        # A float copy: the caller's logits stay as they are.
        buf = logits.to(torch.float32, copy=True).reshape(-1, logits.shape[-1])
        loss, ctx.state = _forward_(buf, target.reshape(-1), group, label_smoothing)
        ctx.save_for_backward(buf)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_output):
        buf, = ctx.saved_tensors
        grad = _backward_(buf, ctx.state, grad_output.reshape(-1))
        return grad.view(ctx.shape).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits, target, group=None, label_smoothing=0.0):
    """Per-token loss [...] from vocab-parallel logits [..., V/TP] and targets [...] (the
    logits are left as they are; the GPT's head uses `linear_cross_entropy`)."""
    return _VocabParallelCrossEntropy.apply(logits, target, group, label_smoothing)


class LogitsBuffers:
    """Logits-sized tensors kept from one step to the next on CPUs (other devices have
    a caching allocator of their own: there `take` simply allocates). A buffer goes
    back with `give` once its backward is done; several are out at once only while
    a pipeline schedule holds several micro batches' logits. Only the latest shape of
    each dtype is kept, so that evaluation over inputs of many lengths holds one size."""

    def __init__(self):
        self._free: Dict[tuple, List[torch.Tensor]] = {}  # (shape, dtype, device) -> buffers

    def take(self, shape, dtype, device) -> torch.Tensor:
        if device.type == "cpu":
            free = self._free.get((tuple(shape), dtype, device))
            if free:
                return free.pop()
        return torch.empty(shape, dtype=dtype, device=device)

    def give(self, buf: torch.Tensor) -> None:
        if buf.device.type != "cpu":
            return
        key = (tuple(buf.shape), buf.dtype, buf.device)
        for other in [k for k in self._free if k[1:] == key[1:] and k != key]:
            del self._free[other]
        self._free.setdefault(key, []).append(buf)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, group, buffers, vocab_limit, float_loss,
                label_smoothing, for_backward):
        rows, cols = hidden.shape[0], weight.shape[0]
        logits = buffers.take((rows, cols), hidden.dtype, hidden.device)
        torch.mm(hidden, weight.t(), out=logits)
        if vocab_limit is not None:  # padding rows of the vocabulary never count
            first = group_rank(group) * cols
            logits[:, max(vocab_limit - first, 0):].fill_(float("-inf"))
        buf = logits
        if float_loss and label_smoothing == 0 and fused.softmax_grad_fusable(logits):
            loss, state = _forward_grad_(logits, target, group, for_backward), None
        else:
            if float_loss and logits.dtype != torch.float32:
                buf = buffers.take((rows, cols), torch.float32, hidden.device)
                buf.copy_(logits)
                buffers.give(logits)
            loss, state = _forward_(buf, target, group, label_smoothing)
        if for_backward:
            ctx.save_for_backward(hidden, weight, buf)
            ctx.state, ctx.buffers = state, buffers
            ctx.main_grad = main_grad_of(weight, widening=True)
        else:
            buffers.give(buf)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.buffers is None:
            raise RuntimeError("the fused output layer and cross entropy cannot run backward "
                               "twice (its logits buffer was turned into the gradient)")
        hidden, weight, buf = ctx.saved_tensors
        buffers, ctx.buffers = ctx.buffers, None
        if ctx.state is None:  # buf: softmax - one_hot, to be scaled by each row's grad_loss
            grad, row_scale = buf, grad_loss.float().unsqueeze(-1)
            hidden = (hidden.float() * row_scale).to(hidden.dtype)
        else:
            grad, row_scale = _backward_(buf, ctx.state, grad_loss), None
            if grad.dtype != hidden.dtype:
                grad = buffers.take(buf.shape, hidden.dtype, buf.device).copy_(buf)
                buffers.give(buf)
        grad_hidden = grad.mm(weight) if ctx.needs_input_grad[0] else None
        if grad_hidden is not None and row_scale is not None:
            grad_hidden = (grad_hidden.float() * row_scale).to(grad_hidden.dtype)
        grad_weight, main_grad = None, ctx.main_grad
        if main_grad is not None and main_grad.dtype == grad.dtype:  # into the reducer's buffer
            main_grad.addmm_(grad.t(), hidden)
        elif main_grad is not None:  # 16 bits widened as they are added, so a tied input
            # embedding's gradient (the reducer's hook) meets this one in float32
            fused.add_to_float_(main_grad, grad.t().mm(hidden))
        elif ctx.needs_input_grad[1]:
            grad_weight = grad.t().mm(hidden)
        buffers.give(grad)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         group=None, buffers: Optional[LogitsBuffers] = None,
                         vocab_limit: Optional[int] = None, float_loss: bool = True,
                         label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token losses [...] of `hidden` [..., h] through the vocab-parallel output
    layer `weight` [V / TP, h] against targets [...] (global ids), without ever
    returning the logits. `vocab_limit`: ids at or beyond it (vocabulary padding) get
    probability 0. `float_loss`: 16-bit logits are converted to float32 for the loss
    (Megatron's default; off is --fp16-lm-cross-entropy). The gradient is the same as
    that of `vocab_parallel_cross_entropy(F.linear(hidden, weight), target)`.
    Label smoothing and a `vocab_limit` that masks columns are refused: the smoothing term
    averages log p over every column, and the masked ones (log 0) would make it NaN; no
    flag sets label smoothing for the GPT today."""
    vocab = weight.shape[0] * group_size(group)
    if label_smoothing > 0 and vocab_limit is not None and vocab_limit < vocab:
        raise ValueError(f"label_smoothing {label_smoothing} with vocab_limit {vocab_limit} "
                         f"(of {vocab} vocabulary columns) would average log 0 of the masked "
                         f"padding columns into the loss (NaN); pass label_smoothing=0 or "
                         f"vocab_limit=None")
    buffers = buffers if buffers is not None else LogitsBuffers()
    for_backward = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss = _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                     target.reshape(-1), group, buffers, vocab_limit,
                                     float_loss, label_smoothing, for_backward)
    return loss.view(target.shape)
