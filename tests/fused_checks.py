"""Shared by the CPU and CUDA fused-kernel tests: dtypes, tolerances, error measure."""
import torch

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
