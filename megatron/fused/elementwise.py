"""Element-wise fusions: bias + GeLU, dropout, bias + dropout + add, the cross
entropy's exp_sum_, max_exp_sum and softmax_minus_target_, and add_to_float_.

bias_gelu (tanh-approximated GeLU of y + bias) has a CPU kernel: one pass forward,
one pass backward that also sums the bias gradient; it computes tanh through
exp (0.5 u (1 + tanh z) = u * sigmoid(2 z)), within a few ulp of torch's GeLU.
Elsewhere it is plain PyTorch (on CUDA `F.gelu` is one fused kernel already).
exp_sum_ (the cross entropy's softmax numerator, in place) has a CPU kernel too, and so
do max_exp_sum and softmax_minus_target_, the cross entropy of bfloat16 logits that turns
them into their gradient without a float32 copy (mpu/cross_entropy.py).

dropout (and bias_dropout_add) with fusion on a CPU draws its keep-mask with
one `rand_like` comparison, about twice as fast as `F.dropout`'s Bernoulli
sampling there; the masks differ from `F.dropout`'s but come from the same
generator, so activation recomputation reproduces them. On CUDA `F.dropout`
is already a fused kernel and is used as is.

add_to_float_ adds a bfloat16 gradient into its float32 accumulator (the reducer's
main_grad) in one pass on CPUs, where torch's mixed-dtype add_ first makes a float32 copy.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.fused import choice
from megatron.fused import kernels as fused_kernels
from megatron.fused.paths import KERNEL_DTYPES, _ext


class FusedBiasGeLU(torch.autograd.Function):
    """tanh-approximated GeLU of y + bias in one pass (CPU kernel); saves y and the bias
    (not their sum) and sums the bias gradient in the same pass as dy."""

    @staticmethod
    def forward(ctx, y, bias):
        shape = y.shape
        y2 = y.reshape(-1, shape[-1]).contiguous()
        bias = bias.contiguous() if bias is not None else None
        out = _ext(y).bias_gelu_forward(y2, bias)
        ctx.save_for_backward(y2, bias)
        ctx.shape = shape
        return out.view(shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        y2, bias = ctx.saved_tensors
        dy, dbias = _ext(y2).bias_gelu_backward(grad.reshape(y2.shape).contiguous(), y2, bias)
        return dy.view(ctx.shape), dbias


def bias_gelu_fusable(y, bias) -> bool:
    """The CPU kernel applies: y on a CPU, float32/bfloat16/float16, bias None or [hidden]
    of y's dtype."""
    if y.device.type != "cpu" or y.dtype not in KERNEL_DTYPES or y.dim() < 1:
        return False
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != y.shape[-1]
                             or bias.dtype != y.dtype or bias.device != y.device):
        return False
    module = fused_kernels.get_extension("cpu")
    return module is not None and hasattr(module, "bias_gelu_forward")


def bias_gelu(bias, y, fusion=True):
    """tanh-approximated GeLU of y + bias (bias may be None)."""
    if fusion and bias_gelu_fusable(y, bias):
        return FusedBiasGeLU.apply(y, bias)
    return F.gelu(y if bias is None else y + bias, approximate="tanh")


def dropout(x, prob, training, fusion=True):
    """Inverted dropout: zero each element with probability `prob`, scale the rest."""
    if not training or prob == 0.0:
        return x
    if not fusion or x.device.type != "cpu" or prob >= 1.0:
        return F.dropout(x, p=prob, training=True)
    keep = torch.rand(x.shape, dtype=torch.float32, device=x.device) >= prob
    return x * keep * (1.0 / (1.0 - prob))


def bias_dropout_add(x, bias, residual, prob, training, fusion=True):
    """residual + dropout(x + bias)."""
    if bias is not None:
        x = x + bias
    return residual + dropout(x, prob, training, fusion)


def add_to_float_(acc, x):
    """acc += x in place; returns acc. The same bits as acc.add_(x) (x widened exactly, one
    float32 add). A contiguous float32 acc on a CPU and a contiguous bfloat16 x of its size
    take the kernel, which widens x as it adds: torch's add_ first copies x to a new float32
    tensor (1.7 of the 2.2 ms that adding the [8064, 256] head gradient took in
    `bench_train_step.py --bf16`, fresh pages included). Anything else is acc.add_(x)."""
    if (acc.device.type == "cpu" and acc.dtype == torch.float32 and x.dtype == torch.bfloat16
            and x.device == acc.device and acc.numel() == x.numel() and acc.is_contiguous()
            and x.is_contiguous()):
        module = fused_kernels.get_extension("cpu")
        if module is not None and hasattr(module, "add_to_float_"):
            module.add_to_float_(acc, x)
            return acc
    return acc.add_(x)


def _plain_exp_sum_(x, row_max):
    if row_max is None:
        row_max = x.amax(dim=-1).float()
    x.sub_(row_max.unsqueeze(-1)).exp_()
    return row_max, x.sum(dim=-1, dtype=torch.float32)


def exp_sum_(x, row_max=None, fusion=True):
    """x [rows, n] <- exp(x - row_max[:, None]), in place; returns (row_max, row sums of
    the result), both float32 [rows]. `row_max` None: each row's own max. The softmax of
    the cross entropy without a second logits-sized tensor; on CPUs one pass per row
    (`exp_sum_` kernel) instead of four over the whole tensor, where `--fused-kernels-choice`
    takes it (auto: measured per dtype and powers of two of rows and n: fused/choice.py)."""
    module = fused_kernels.get_extension("cpu") if x.device.type == "cpu" else None
    if (fusion and module is not None and hasattr(module, "exp_sum_") and x.dim() == 2
            and x.is_contiguous() and x.dtype in KERNEL_DTYPES
            and choice.prefer_ours(exp_sum_decision(x))):
        return module.exp_sum_(x, None if row_max is None else row_max.float().contiguous())
    return _plain_exp_sum_(x, row_max)


def softmax_grad_fusable(x) -> bool:
    """The cross entropy of bfloat16 logits x [rows, n] can take its float32 softmax without
    keeping it (`max_exp_sum`, `softmax_minus_target_`): a contiguous CPU tensor and the
    kernels built."""
    if x.device.type != "cpu" or x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous():
        return False
    module = fused_kernels.get_extension("cpu")
    return module is not None and hasattr(module, "softmax_minus_target_")


def max_exp_sum(x):
    """(row max, row sums of exp(x - row max)), float32 [rows], of logits x [rows, n] (left as
    they are; check `softmax_grad_fusable`). A row of -inf throughout has sum 0."""
    return _ext(x).max_exp_sum(x)


def softmax_minus_target_(x, target, row_max=None, sums=None):
    """x [rows, n] <- softmax(x) - one_hot(target), in place, computed in float32 and rounded
    once; returns (row max, row sums of exp(x - row max)), float32 [rows]. target [rows]: the
    column in this shard, -1 where the target lies in another. row_max and sums: those over
    the whole vocabulary (every tensor-parallel shard's columns, from `max_exp_sum`), else
    each row's own (one pass over x)."""
    stats = (None, None) if row_max is None else (row_max.float().contiguous(),
                                                  sums.float().contiguous())
    return _ext(x).softmax_minus_target_(x, target.long().contiguous(), *stats)


def exp_sum_decision(x) -> choice.Decision:
    """The decision of exp_sum_ on logits x [rows, n]: dtype, powers of two of rows and n."""
    return choice.Decision("exp_sum", str(x.dtype)[6:], (("rows", choice.bucket(x.shape[0])),
                                                         ("n", choice.bucket(x.shape[1]))))


# A timing of exp_sum_ runs at most this many elements (64 MiB of float32).
EXP_SUM_ELEMENTS = 1 << 24


def _exp_sum_steps(dims, dtype):
    """(ours, plain) steps of exp_sum_ on a copy of fixed logits (both pay the copy)."""
    n = dims["n"]
    rows = max(1, min(dims["rows"], EXP_SUM_ELEMENTS // n))
    logits = torch.randn(rows, n, dtype=dtype)
    buf = torch.empty_like(logits)
    module = fused_kernels.get_extension("cpu")
    return (lambda: module.exp_sum_(buf.copy_(logits), None),
            lambda: _plain_exp_sum_(buf.copy_(logits), None))


choice.register("exp_sum", _exp_sum_steps, lambda dims, dtype: True,
                lambda dims: "PyTorch ops")
