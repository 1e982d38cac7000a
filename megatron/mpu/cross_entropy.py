"""Cross entropy over logits whose vocabulary is split across tensor-parallel ranks.

The full logits are never gathered: each rank holds [..., V / TP]; the max and
the sum of exponentials are all-reduced over the group, and so is the logit of
the target, which lives on exactly one rank. The math lives in static methods
apart from the three all-reduces. Without tensor parallelism it is torch's own
cross entropy (one log-softmax, no extra copies of the logits).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.mpu.mappings import all_reduce, group_rank, group_size


def vocab_range(per_partition: int, rank: int):
    """[first, last) vocabulary ids held by `rank`."""
    first = rank * per_partition
    return first, first + per_partition


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, label_smoothing=0.0):
        logits = logits.float()
        local_max = logits.max(dim=-1)[0]
        global_max = all_reduce(local_max, group, op=dist.ReduceOp.MAX)
        shifted = logits - global_max.unsqueeze(-1)
        first, last = vocab_range(logits.shape[-1], group_rank(group))
        target_logit, target_mask, local_target = _VocabParallelCrossEntropy.target_logits(
            shifted, target, first, last)
        target_logit = all_reduce(target_logit, group)
        exp = shifted.exp()
        sum_exp = all_reduce(exp.sum(dim=-1), group)
        loss = sum_exp.log() - target_logit
        vocab_size = logits.shape[-1] * group_size(group)
        if label_smoothing > 0:
            loss = _VocabParallelCrossEntropy.smooth(
                loss, shifted, sum_exp, label_smoothing, vocab_size, group)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, target_mask, local_target)
        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        return loss

    @staticmethod
    def target_logits(shifted, target, first, last):
        """The logit of each target on this rank's shard (0 where the target is elsewhere)."""
        target_mask = (target < first) | (target >= last)
        local_target = (target - first).masked_fill(target_mask, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        return picked.masked_fill(target_mask, 0.0), target_mask, local_target

    @staticmethod
    def smooth(loss, shifted, sum_exp, eps, vocab_size, group):
        """(1 - eps) * nll + eps * mean over the vocabulary of -log p."""
        log_probs_sum = all_reduce(shifted.sum(dim=-1), group) - vocab_size * sum_exp.log()
        return (1.0 - eps) * loss - eps * log_probs_sum / vocab_size

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, local_target = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax
        one_hot = (~target_mask).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(1.0 - eps) * one_hot.unsqueeze(-1))
        if eps > 0:
            grad.sub_(eps / ctx.vocab_size)
        grad.mul_(grad_output.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits, target, group=None, label_smoothing=0.0):
    """Per-token loss [...] from vocab-parallel logits [..., V/TP] and targets [...]."""
    if group_size(group) == 1:
        vocab = logits.shape[-1]
        return F.cross_entropy(logits.float().reshape(-1, vocab), target.reshape(-1), reduction="none",
                               label_smoothing=label_smoothing).view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target, group, label_smoothing)
