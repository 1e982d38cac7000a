"""Fused operations used by the transformer, each with a plain-PyTorch path.

The softmax, layer-norm and RMSNorm kernels live in `csrc/fused` (C++ for CPU, CUDA for
GPUs) and are built on first use by `fused_kernels`. Each call picks the fused
kernel when it is built and the inputs meet its constraints, else the plain
PyTorch path below (also the reference the kernels are tested against).
`fusion=False` always takes the plain path.

Fused-path constraints (checked per call; anything else runs plain PyTorch):

attention_softmax, scores [b, np, sq, sk]:
  - dtype float32, bfloat16 or float16 (arithmetic in float32 whatever
    `softmax_in_fp32` says, output in the scores' dtype);
  - device CPU, or CUDA with sk <= 8192 (rows are staged in shared memory);
  - `causal` and no mask with sq == sk: `scaled_upper_triang_masked_softmax`;
  - otherwise `scaled_masked_softmax`: the mask must be bool/uint8 and
    broadcastable to [b, 1, sq, sk] (no per-head masks); it is expanded to
    [b or 1, 1, sq, sk] and combined with the causal mask when `causal`.
layer_norm, rms_norm:
  - layer_norm on a CPU: one autograd node in C++ (`fused_layer_norm`), taken by default
    (`layer_norm_preferred`: bench_fused measured it at least as fast as F.layer_norm);
  - normalises the last dim only, weight (and for layer_norm bias) given, [hidden]
    of the input's dtype (float32, bfloat16 or float16);
  - CUDA: hidden <= 8192.
All: fewer than 2**31 rows (one CUDA block per row).

rms_norm's kernels round x * rsqrt(mean(x^2) + eps) to the input's dtype before
multiplying by the weight, as the plain path (and Hugging Face's LlamaRMSNorm) do.

Masked scores take -10000.0 before the softmax (Megatron's convention), so a
fully masked row comes out uniform, as in the plain path.

bias_gelu (tanh-approximated GeLU of y + bias) has a CPU kernel: one pass forward,
one pass backward that also sums the bias gradient; it computes tanh through
exp (0.5 u (1 + tanh z) = u * sigmoid(2 z)), within a few ulp of torch's GeLU.
Elsewhere it is plain PyTorch (on CUDA `F.gelu` is one fused kernel already).
exp_sum_ (the cross entropy's softmax numerator, in place) has a CPU kernel too.

dropout (and bias_dropout_add) with fusion on a CPU draws its keep-mask with
one `rand_like` comparison, about twice as fast as `F.dropout`'s Bernoulli
sampling there; the masks differ from `F.dropout`'s but come from the same
generator, so activation recomputation reproduces them. On CUDA `F.dropout`
is already a fused kernel and is used as is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.fused import kernels as fused_kernels

MASKED_VALUE = -10000.0
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Longest softmax row / layer-norm row per device type; None means no limit.
MAX_ROW_LENGTH = {"cpu": None, "cuda": 8192}

UPPER_TRIANG = "scaled_upper_triang_masked_softmax"
MASKED = "scaled_masked_softmax"

_ANNOUNCED: set = set()


def announce(op: str, path: str) -> None:
    """Prints the path `op` (attention, layer norm, RMSNorm) takes, once per path and
    process, on rank 0; nothing while torch.compile traces (no graph break)."""
    if (op, path) in _ANNOUNCED or torch.compiler.is_compiling():
        return
    _ANNOUNCED.add((op, path))
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f" {op}: {path}", flush=True)


def _announce_norm(op: str, x: torch.Tensor, kernel: bool, fusion: bool, plain: str) -> None:
    """announce() for a norm: our kernel (with the CPU's instruction set), or the plain path
    and why. The key is checked before any string is built: this runs on every call."""
    if torch.compiler.is_compiling() or (op, x.device.type, kernel, fusion) in _ANNOUNCED:
        return
    _ANNOUNCED.add((op, x.device.type, kernel, fusion))
    if kernel:
        isa = f", {cpu_kernels_isa()}" if x.device.type == "cpu" else ""
        path = f"our {x.device.type.upper()} kernel{isa}"
    else:
        why = ("fusion off" if not fusion else
               "kernels not built" if fused_kernels.get_extension(x.device.type) is None else
               f"{str(x.dtype)[6:]} [..., {x.shape[-1]}] outside the kernel's constraints")
        path = f"{plain} ({why})"
    announce(op, path)


def _ext(tensor: torch.Tensor):
    module = fused_kernels.get_extension(tensor.device.type)
    if module is None:
        raise RuntimeError(f"fused kernels are not available for device {tensor.device}; "
                           "call attention_softmax/layer_norm, which fall back to PyTorch")
    return module


# ----------------------------------------------------------------------------------
# Autograd functions around the kernels
# ----------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------
# Attention softmax
# ----------------------------------------------------------------------------------

def _row_fits(device: torch.device, length: int) -> bool:
    if device.type not in MAX_ROW_LENGTH:
        return False
    limit = MAX_ROW_LENGTH[device.type]
    return length >= 1 and (limit is None or length <= limit)


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


# ----------------------------------------------------------------------------------
# Layer norm
# ----------------------------------------------------------------------------------

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
    applies (`layer_norm_fusable`) and is built. On CPUs `benchmarks/bench_fused.py` (forward+
    backward, [8192, 1024], [4096, 512] and [2048, 256], float32 and bfloat16) measured it at
    least as fast as F.layer_norm on AVX2 and on AVX-512: its outputs of 2 MiB and more reuse
    freed buffers instead of faulting in fresh pages (3-4x at [8192, 1024] float32), its
    backward is faster, and the autograd node is C++ (a Python Function cost ~30 us a step)."""
    return (layer_norm_fusable(x, weight, bias)
            and fused_kernels.get_extension(x.device.type) is not None)


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
    _announce_norm("layer norm", x, kernel, fusion, "F.layer_norm")
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


# ----------------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------------

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
    kernel = (fusion and rms_norm_fusable(x, weight)
              and fused_kernels.get_extension(x.device.type) is not None)
    _announce_norm("RMSNorm", x, kernel, fusion, "float32 PyTorch ops")
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


# ----------------------------------------------------------------------------------
# Element-wise fusions (plain PyTorch; see the module docstring)
# ----------------------------------------------------------------------------------

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


def _plain_exp_sum_(x, row_max):
    if row_max is None:
        row_max = x.amax(dim=-1).float()
    x.sub_(row_max.unsqueeze(-1)).exp_()
    return row_max, x.sum(dim=-1, dtype=torch.float32)


def exp_sum_(x, row_max=None, fusion=True):
    """x [rows, n] <- exp(x - row_max[:, None]), in place; returns (row_max, row sums of
    the result), both float32 [rows]. `row_max` None: each row's own max. The softmax of
    the cross entropy without a second logits-sized tensor; on CPUs one pass per row
    (`exp_sum_` kernel) instead of four over the whole tensor."""
    module = fused_kernels.get_extension("cpu") if x.device.type == "cpu" else None
    if (fusion and module is not None and hasattr(module, "exp_sum_") and x.dim() == 2
            and x.is_contiguous() and x.dtype in KERNEL_DTYPES):
        return module.exp_sum_(x, None if row_max is None else row_max.float().contiguous())
    return _plain_exp_sum_(x, row_max)


class FusedCausalAttention(torch.autograd.Function):
    """softmax(scale * q k^T, causal) v of q, k, v [sq, b, heads, head_dim] -> [sq, b, heads,
    head_dim], flash-attention style on CPUs (saves the output and each row's log-sum-exp;
    the backward recomputes the probabilities). With dropout_p > 0 the probabilities are
    dropped by the kernel's counter-based mask of `seed` (`attention_dropout_keep`), which
    the backward regenerates."""

    @staticmethod
    def forward(ctx, q, k, v, scale, dropout_p=0.0, seed=0):
        out, lse = _ext(q).causal_attention_forward(q, k, v, float(scale), True,
                                                    float(dropout_p), int(seed))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.dropout = float(scale), (float(dropout_p), int(seed))
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        dq, dk, dv = _ext(q).causal_attention_backward(grad, q, k, v, out, lse, ctx.scale, True,
                                                       *ctx.dropout)
        return dq, dk, dv, None, None, None


# The kernels' dropout counts positions i * sq + j in 32 bits.
MAX_DROPOUT_SEQ = 65535


def causal_attention_fusable(q, k, v, dropout_p: float = 0.0) -> bool:
    """The CPU kernel applies: float32 q, k, v of one shape [sq, b, heads, head_dim] on a CPU
    (self-attention, sq == sk), head_dim a multiple of 16 and contiguous; with dropout,
    0 < dropout_p < 1 and sq <= MAX_DROPOUT_SEQ."""
    tensors = (q, k, v)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() != 4
           or t.shape != q.shape or t.stride(-1) != 1 for t in tensors):
        return False
    if q.shape[-1] % 16:
        return False
    if dropout_p and not (0.0 <= dropout_p < 1.0 and q.shape[0] <= MAX_DROPOUT_SEQ):
        return False
    module = fused_kernels.get_extension("cpu")
    return module is not None and hasattr(module, "attention_dropout_keep")


def attention_with_lse(q, k, v, scale, causal=True):
    """(out [sq, b, heads, head_dim], lse float32 [b * heads, sq]) of the CPU kernel, without
    autograd, over keys j <= i (causal) or all keys: the blocks of ring attention, whose
    log-sum-exps merge with the other blocks' (check `causal_attention_fusable` first)."""
    return _ext(q).causal_attention_forward(q, k, v, float(scale), bool(causal))


def attention_with_lse_backward(dout, q, k, v, out, lse, scale, causal=True):
    """(dq, dk, dv) of the CPU kernel for a given output and log-sum-exp: with those of the
    whole row (merged over every key block) it gives one block's share of the gradients."""
    return _ext(q).causal_attention_backward(dout, q, k, v, out, lse.contiguous(), float(scale),
                                             bool(causal))


def attention_dropout_keep(tasks: int, sq: int, dropout_p: float, seed: int) -> torch.Tensor:
    """The bool keep mask [tasks, sq, sq] that the CPU kernel applies for (dropout_p, seed),
    task = batch * heads + head: for references (the explicit path with the same mask)."""
    return _ext(torch.empty(0)).attention_dropout_keep(tasks, sq, float(dropout_p),
                                                       int(seed)).bool()


def attention_dropout_seed() -> int:
    """A dropout seed for the kernel, drawn from torch's generator of this context (under
    the RNG tracker's fork: the tensor-model-parallel state), so that recomputation under
    the same state draws the same seed and mask."""
    return int(torch.randint(0, 2**62, (1,)).item())


# Longest sequence at which our attention kernel beats SDPA's CPU kernel, per instruction
# set of the kernels (forward+backward, `benchmarks/bench_fused.py --only attention`, two
# threads: AVX-512 1.3-1.7x at seq 256-4096; AVX2 1.4-1.6x at 256 and 512, at 1024 1.04-1.14x
# in six runs since the threads claim tasks dynamically (quiet and with 1 or 3 competing
# processes), 0.7-0.9x at 2048 and 4096). None: no limit; the baseline build was not
# measured, so SDPA there.
KERNEL_MAX_SEQ = {"avx512": None, "avx2": 1024, "baseline": 0}
# With attention dropout our kernel runs at every length on these ISAs: its alternative is
# the explicit path (SDPA with dropout on a CPU is unfused math with Bernoulli sampling), 5-9x
# slower at seq 256-4096 (`bench_fused.py --only attention_dropout`).
KERNEL_WITH_DROPOUT = ("avx512", "avx2")


def causal_attention_preferred(q, k, v, dropout_p: float = 0.0) -> bool:
    """Whether `--attention-impl auto` runs our CPU kernel for causal self-attention of these
    q, k, v (no mask, no bias) with this attention dropout (0 when not training): it
    applies (`causal_attention_fusable`) and, by the measured rule above, is faster than
    the other path on this instruction set."""
    if not causal_attention_fusable(q, k, v, dropout_p):
        return False
    isa = cpu_kernels_isa()
    if dropout_p > 0:
        return isa in KERNEL_WITH_DROPOUT
    limit = KERNEL_MAX_SEQ.get(isa, 0)
    return limit is None or q.shape[0] <= limit


def causal_attention(q, k, v, scale, dropout_p: float = 0.0, seed: int | None = None):
    """Causal self-attention of q, k, v [sq, b, heads, head_dim] -> [sq, b, heads * head_dim]
    with the CPU kernel (check `causal_attention_fusable` first); dropout_p > 0 drops
    probabilities with the mask of `seed` (None: `attention_dropout_seed()`)."""
    sq, b, heads, dim = q.shape
    if dropout_p > 0 and seed is None:
        seed = attention_dropout_seed()
    return FusedCausalAttention.apply(q, k, v, scale, dropout_p, seed or 0).view(
        sq, b, heads * dim)


def cpu_kernels_isa() -> str:
    """The instruction set the loaded CPU kernels were built for (avx512, avx2, baseline)."""
    module = fused_kernels.get_extension("cpu")
    return getattr(module, "isa", "unknown") if module is not None else "not built"
