"""Shared by the CPU and CUDA fused-kernel tests: dtypes, tolerances, error measure, and the
`kernels` fixture of the CPU tests (import it into a test module to load the kernels there)."""
import os

import pytest
import torch

from megatron.fused import kernels as fused_kernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def rel_err(actual, expected):
    """max |actual - expected| / max |expected|, in float64; fails on non-finite values
    (the kernels' outputs are poisoned with NaN, so an unwritten element shows here)."""
    actual, expected = actual.double(), expected.double()
    assert torch.isfinite(actual).all(), "non-finite values (unwritten output?)"
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def outputs_and_grads(fn, tensors, grad):
    """fn(*tensors) and the gradients of its inputs for the output gradient `grad`."""
    inputs = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*inputs)
    out.backward(grad)
    return out.detach(), [t.grad for t in inputs]


def explicit_attention(q, k, v, scale, causal=True, keep=None, dropout_p=0.0):
    """softmax(scale q k^T) v of q, k, v [s, b, heads, d] -> [s, b, heads * d] in plain
    PyTorch: over keys j <= i (causal) or all keys; keep (bool [b * heads, s, s], the CPU
    kernel's mask from `fused.attention_dropout_keep`) drops probabilities as the kernel
    does (kept ones scaled by 1 / (1 - dropout_p))."""
    s, b, heads, d = q.shape
    qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if causal:
        future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if keep is not None:
        probs = probs * keep.view(b, heads, s, s) / (1.0 - dropout_p)
    return torch.matmul(probs, vh).permute(2, 0, 1, 3).reshape(s, b, heads * d)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    """Loads the CPU kernels with poisoned outputs for the module's tests (failing, not
    skipping, when they do not build)."""
    if os.environ.get(fused_kernels.DISABLE_ENV, "0") not in ("", "0"):
        pytest.skip(f"{fused_kernels.DISABLE_ENV} is set")
    assert fused_kernels.load_fused_kernels(), "the CPU fused kernels failed to build"
    fused_kernels.set_poison_outputs(True)
    yield fused_kernels.get_extension("cpu")
    fused_kernels.set_poison_outputs(False)
