"""Attention softmax: softmax(scale * scores) with the future and/or a mask removed.

The kernels live in `csrc/fused` (C++ for CPU, CUDA for GPUs). Fused-path constraints
(checked per call by `softmax_kernel_for`; anything else runs plain PyTorch), scores
[b, np, sq, sk]:
  - dtype float32, bfloat16 or float16 (arithmetic in float32 whatever
    `softmax_in_fp32` says, output in the scores' dtype);
  - device CPU, or CUDA with sk <= 8192 (rows are staged in shared memory);
  - `causal` and no mask with sq == sk: `scaled_upper_triang_masked_softmax`;
  - otherwise `scaled_masked_softmax`: the mask must be bool/uint8 and
    broadcastable to [b, 1, sq, sk] (no per-head masks); it is expanded to
    [b or 1, 1, sq, sk] and combined with the causal mask when `causal`;
  - fewer than 2**31 rows (one CUDA block per row).

Masked scores take -10000.0 before the softmax (Megatron's convention), so a
fully masked row comes out uniform, as in the plain path.
"""
from __future__ import annotations

import torch

from megatron.fused import kernels as fused_kernels
from megatron.fused.paths import KERNEL_DTYPES, _ext, _row_fits

MASKED_VALUE = -10000.0

UPPER_TRIANG = "scaled_upper_triang_masked_softmax"
MASKED = "scaled_masked_softmax"


class ScaledUpperTriangMaskedSoftmax(torch.autograd.Function):
    """softmax(scale * x) over the last dim of x [attn_batches, sq, sq], future masked."""

    @staticmethod
    def forward(ctx, inputs, scale):
        probs = _ext(inputs).scaled_upper_triang_masked_softmax_forward(
            inputs.contiguous(), float(scale))
        ctx.scale = float(scale)
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (probs,) = ctx.saved_tensors
        dx = _ext(probs).scaled_upper_triang_masked_softmax_backward(
            grad.contiguous(), probs, ctx.scale)
        return dx, None


class ScaledMaskedSoftmax(torch.autograd.Function):
    """softmax(scale * x) of x [b, np, sq, sk] with mask [b or 1, 1, sq, sk] (True = hidden)."""

    @staticmethod
    def forward(ctx, inputs, mask, scale):
        mask = mask.contiguous()
        probs = _ext(inputs).scaled_masked_softmax_forward(
            inputs.contiguous(), mask, float(scale))
        ctx.scale = float(scale)
        ctx.save_for_backward(probs, mask)
        return probs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        probs, mask = ctx.saved_tensors
        dx = _ext(probs).scaled_masked_softmax_backward(
            grad.contiguous(), probs, mask, ctx.scale)
        return dx, None, None


def _mask_fits(mask: torch.Tensor, b: int, sq: int, sk: int) -> bool:
    if mask.dtype not in (torch.bool, torch.uint8) or mask.dim() > 4:
        return False
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    return (shape[0] in (1, b) and shape[1] == 1
            and shape[2] in (1, sq) and shape[3] in (1, sk))


def softmax_kernel_for(scores: torch.Tensor, causal: bool, mask=None) -> str | None:
    """Name of the kernel the fused path would use for these inputs, or None.

    A pure check of the constraints (see the module docstring); builds nothing.
    """
    if scores.dim() != 4 or scores.dtype not in KERNEL_DTYPES or scores.numel() == 0:
        return None
    b, _, sq, sk = scores.shape
    if not _row_fits(scores.device, sk) or scores.numel() // sk >= 2**31:
        return None
    if mask is None:
        return UPPER_TRIANG if causal and sq == sk else MASKED
    if mask.device != scores.device or not _mask_fits(mask, b, sq, sk):
        return None
    return MASKED


def _kernel_mask(mask, causal: bool, b: int, sq: int, sk: int, device) -> torch.Tensor:
    """mask as a [b or 1, 1, sq, sk] bool tensor, with the future hidden when causal."""
    if mask is None:
        kernel_mask = torch.zeros(1, 1, sq, sk, dtype=torch.bool, device=device)
    else:
        kernel_mask = mask.bool().reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        mb = b if kernel_mask.shape[0] == b else 1
        kernel_mask = kernel_mask.expand(mb, 1, sq, sk)
    if causal:
        future = torch.ones(sq, sk, dtype=torch.bool, device=device).triu(sk - sq + 1)
        kernel_mask = kernel_mask | future
    return kernel_mask.contiguous()


def _fused_attention_softmax(scores, scale, causal, mask):
    """Fused softmax, or None when the inputs or the machine do not allow it."""
    kernel = softmax_kernel_for(scores, causal, mask)
    if kernel is None or fused_kernels.get_extension(scores.device.type) is None:
        return None
    b, np_, sq, sk = scores.shape
    if kernel == UPPER_TRIANG:
        flat = scores.reshape(b * np_, sq, sk)
        return ScaledUpperTriangMaskedSoftmax.apply(flat, scale).view(b, np_, sq, sk)
    kernel_mask = _kernel_mask(mask, causal, b, sq, sk, scores.device)
    return ScaledMaskedSoftmax.apply(scores, kernel_mask, scale)


def _plain_attention_softmax(scores, scale, causal, mask, softmax_in_fp32):
    dtype = scores.dtype
    x = scores.float() if softmax_in_fp32 else scores
    x = x * scale
    if causal:
        sq, sk = x.shape[-2:]
        future = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(sk - sq + 1)
        x = x.masked_fill(future, MASKED_VALUE)
    if mask is not None:
        x = x.masked_fill(mask.bool(), MASKED_VALUE)
    return torch.softmax(x, dim=-1).to(dtype)


def attention_softmax(scores, *, scale, causal, mask=None, softmax_in_fp32=True, fusion=True):
    """softmax(scale * scores) with the future (causal) and/or `mask` (True = hidden) removed.

    scores: [b, np, sq, sk]; mask: bool, broadcastable to scores, or None.
    Returns probabilities in the dtype of `scores`.
    """
    if fusion:
        probs = _fused_attention_softmax(scores, float(scale), causal, mask)
        if probs is not None:
            return probs
    return _plain_attention_softmax(scores, scale, causal, mask, softmax_in_fp32)
