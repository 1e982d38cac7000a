"""Layer norm and RMSNorm over the last dim: the functions, the modules, their kernels'
autograd Functions and the checks of when a kernel applies (`*_fusable`) and runs.

The kernels live in `csrc/fused` (C++ for CPU, CUDA for GPUs). Fused-path constraints
(checked per call; anything else runs plain PyTorch):
  - layer_norm on a CPU: one autograd node in C++ (`fused_layer_norm`), taken where
    `--fused-kernels-choice` takes it (`layer_norm_preferred`; auto: measured against
    F.layer_norm on this machine, megatron/fused/choice.py); RMSNorm likewise;
  - normalises the last dim only, weight (and for layer_norm bias) given, [hidden]
    of the input's dtype (float32, bfloat16 or float16);
  - CUDA: hidden <= 8192;
  - fewer than 2**31 rows (one CUDA block per row).

rms_norm's kernels round x * rsqrt(mean(x^2) + eps) to the input's dtype before
multiplying by the weight, as the plain path (and Hugging Face's LlamaRMSNorm) do.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.fused import choice
from megatron.fused import kernels as fused_kernels
from megatron.fused.paths import KERNEL_DTYPES, _announce_norm, _ext, _row_fits


class FusedLayerNormAffine(torch.autograd.Function):
    """Layer norm over the last dim with weight and bias; saves mean and 1/std."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        hidden = x.shape[-1]
        x2 = x.reshape(-1, hidden).contiguous()
        y, mean, rstd = _ext(x).layer_norm_forward(
            x2, weight.contiguous(), bias.contiguous(), float(eps))
        ctx.shape = x.shape
        ctx.save_for_backward(x2, weight, mean, rstd)
        return y.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x2, weight, mean, rstd = ctx.saved_tensors
        dy = grad.reshape(x2.shape).contiguous()
        dx, dw, db = _ext(x2).layer_norm_backward(dy, x2, mean, rstd, weight.contiguous())
        dw = dw if ctx.needs_input_grad[1] else None
        db = db if ctx.needs_input_grad[2] else None
        return dx.view(ctx.shape), dw, db, None


class FusedRMSNormAffine(torch.autograd.Function):
    """RMSNorm over the last dim with a weight; saves 1/rms per row."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        hidden = x.shape[-1]
        x2 = x.reshape(-1, hidden).contiguous()
        y, rstd = _ext(x).rms_norm_forward(x2, weight.contiguous(), float(eps))
        ctx.shape = x.shape
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x2, weight, rstd = ctx.saved_tensors
        dy = grad.reshape(x2.shape).contiguous()
        dx, dw = _ext(x2).rms_norm_backward(dy, x2, rstd, weight.contiguous())
        return dx.view(ctx.shape), (dw if ctx.needs_input_grad[1] else None), None


def _norm_fusable(x, params) -> bool:
    """Whether a fused norm kernel accepts input x with these [hidden] parameters."""
    if any(p is None for p in params) or x.dim() == 0 or x.numel() == 0:
        return False
    hidden = x.shape[-1]
    return (x.dtype in KERNEL_DTYPES and _row_fits(x.device, hidden)
            and x.numel() // hidden < 2**31
            and all(p.shape == (hidden,) and p.dtype == x.dtype and p.device == x.device
                    for p in params))


def layer_norm_fusable(x, weight, bias) -> bool:
    """Whether the fused layer-norm kernel accepts these inputs (see the module docstring)."""
    return _norm_fusable(x, (weight, bias))


def layer_norm_preferred(x, weight, bias) -> bool:
    """Whether `layer_norm(..., fusion=True)` runs our kernel for these inputs: wherever it
    applies (`layer_norm_fusable`) and is built, on CUDA where `CUDA_RULE` or the mode takes
    it, and on CPUs where `--fused-kernels-choice` takes it (by default measured against
    F.layer_norm per dtype, hidden size and power of two of the rows:
    megatron/fused/choice.py). The rule (`rule`, and decisions not agreed
    across ranks) takes it: `benchmarks/bench_fused.py` (forward+backward, [8192, 1024],
    [4096, 512] and [2048, 256], float32 and bfloat16) measured it at least as fast as
    F.layer_norm on AVX2 and AVX-512 (its outputs reuse freed buffers instead of faulting in
    fresh pages, its backward is faster, its autograd node is C++)."""
    return (layer_norm_fusable(x, weight, bias)
            and fused_kernels.get_extension(x.device.type) is not None
            and _measured_choice("layer_norm", x))


def norm_decision(op: str, x) -> choice.Decision:
    """The decision of a norm (layer_norm, rms_norm) of x [..., hidden]: its dtype, the
    power of two at or above its rows, the hidden size."""
    hidden = x.shape[-1]
    return choice.Decision(op, str(x.dtype)[6:], (("rows", choice.bucket(x.numel() // hidden)),
                                                  ("hidden", hidden)))


# On CUDA the norms follow a fixed rule (choice.py times on CPUs only), set by
# benchmarks/gpu_check.sh on an H200 (forward+backward of [32768, 4096], bf16 and fp16):
# our layer norm 1.03 ms against F.layer_norm's 0.66 ms, so F.layer_norm; our RMSNorm
# 1.00 ms against 5.3 ms for the float32 PyTorch ops, so ours. The modes ours and plain
# (--fused-kernels-choice) still decide.
CUDA_RULE = {"layer_norm": False, "rms_norm": True}


def _measured_choice(op: str, x) -> bool:
    if x.device.type == "cpu":
        return choice.prefer_ours(norm_decision(op, x))
    answer = choice.forced()
    return CUDA_RULE[op] if answer is None else answer


# A timing of a norm decision runs at most this many elements (64 MiB of float32).
MEASURED_ELEMENTS = 1 << 24


def _norm_steps(op: str):
    """measure(dims, dtype) -> (ours, plain) forward+backward steps of the norm `op`."""
    def measure(dims, dtype):
        hidden = dims["hidden"]
        rows = max(1, min(dims["rows"], MEASURED_ELEMENTS // hidden))
        x, grad = torch.randn(rows, hidden, dtype=dtype), torch.randn(rows, hidden, dtype=dtype)
        w, b = torch.randn(hidden, dtype=dtype), torch.randn(hidden, dtype=dtype)

        def step(kernel: bool):
            def run():
                xr, wr, br = (t.detach().requires_grad_() for t in (x, w, b))
                if op == "rms_norm":
                    y = (FusedRMSNormAffine.apply(xr, wr, 1e-5) if kernel
                         else _plain_rms_norm(xr, wr, 1e-5))
                else:
                    y = (fused_layer_norm(xr, wr, br, 1e-5) if kernel
                         else F.layer_norm(xr, (hidden,), wr, br, 1e-5))
                y.backward(grad)
            return run
        return step(True), step(False)
    return measure


choice.register("layer_norm", _norm_steps("layer_norm"), lambda dims, dtype: True,
                lambda dims: "F.layer_norm")
choice.register("rms_norm", _norm_steps("rms_norm"), lambda dims, dtype: True,
                lambda dims: "float32 PyTorch ops")


def fused_layer_norm(x, weight, bias, eps):
    """Our layer-norm kernel, differentiable (check `layer_norm_fusable` first): on CPUs one
    autograd node in C++ (the extension's `layer_norm`), elsewhere `FusedLayerNormAffine`."""
    module = _ext(x)
    if hasattr(module, "layer_norm"):
        return module.layer_norm(x, weight, bias, float(eps))
    return FusedLayerNormAffine.apply(x, weight, bias, eps)


def layer_norm(x, weight, bias, eps, fusion=True):
    """Layer norm of x over its last dim with `weight` and `bias`: our kernel where it is
    the faster path (`layer_norm_preferred`), else F.layer_norm."""
    kernel = fusion and layer_norm_preferred(x, weight, bias)
    declined = not kernel and fusion and layer_norm_fusable(x, weight, bias)
    _announce_norm("layer norm", x, kernel, fusion, "F.layer_norm", declined)
    if kernel:
        return fused_layer_norm(x, weight, bias, eps)
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


class LayerNorm(torch.nn.Module):
    """Layer norm over the last dimension with weight and bias."""

    def __init__(self, hidden_size, eps=1e-5, fusion=True, sequence_parallel=False):
        super().__init__()
        self.eps = eps
        self.fusion = fusion
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size))
        # Replicated over tensor-parallel ranks; under sequence parallelism its
        # gradients are partial sums that must be all-reduced over TP.
        for p in (self.weight, self.bias):
            p.sequence_parallel = sequence_parallel

    def forward(self, x):
        return layer_norm(x, self.weight, self.bias, self.eps, self.fusion)


def _plain_rms_norm(x, weight, eps):
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_norm_fusable(x, weight) -> bool:
    """Whether the fused RMSNorm kernel accepts these inputs (see the module docstring)."""
    return _norm_fusable(x, (weight,))


def rms_norm(x, weight, eps, fusion=True):
    """RMS norm of x over its last dim, times `weight`.

    Normalised in float32 and cast back to x's dtype before the weight is
    applied, as Hugging Face's LlamaRMSNorm does.
    """
    fits = (fusion and rms_norm_fusable(x, weight)
            and fused_kernels.get_extension(x.device.type) is not None)
    kernel = fits and _measured_choice("rms_norm", x)
    _announce_norm("RMSNorm", x, kernel, fusion, "float32 PyTorch ops", fits and not kernel)
    if kernel:
        return FusedRMSNormAffine.apply(x, weight, eps)
    return _plain_rms_norm(x, weight, eps)


class RMSNorm(torch.nn.Module):
    """Root-mean-square norm over the last dimension with a weight (no bias)."""

    def __init__(self, hidden_size, eps=1e-5, fusion=True, sequence_parallel=False):
        super().__init__()
        self.eps = eps
        self.fusion = fusion
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        # As LayerNorm's: replicated over TP, partial gradients under sequence parallelism.
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps, self.fusion)
