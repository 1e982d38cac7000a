"""Fused softmax / layer-norm / RMSNorm CUDA kernels against the plain PyTorch reference.

Skipped without a GPU. Builds megatron_fused_cuda on first use (needs CUDA_HOME).
Outputs are poisoned with NaN before each kernel call to catch unwritten elements.
"""
import pytest
import torch

from megatron import fused
from megatron.fused import kernels as fused_kernels
from tests.fused_checks import DTYPES, outputs_and_grads, rel_err, TOLERANCE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LIMIT = fused.MAX_ROW_LENGTH["cuda"]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    fused_kernels.load_fused_kernels()
    assert fused_kernels.fused_kernels_available("cuda"), "the CUDA kernels failed to build"
    fused_kernels.set_poison_outputs(True)
    yield fused_kernels.get_extension("cuda")
    fused_kernels.set_poison_outputs(False)


def run(fn, tensors, grad):
    """outputs_and_grads, then a device sync so that a kernel fault surfaces here."""
    result = outputs_and_grads(fn, tensors, grad)
    torch.cuda.synchronize()
    return result


def reference_softmax(x, scale, causal, mask, grad):
    return run(lambda t: fused.attention_softmax(t, scale=scale, causal=causal, mask=mask,
                                                 fusion=False), [x.float()], grad.float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,np_,s", [(1, 1, 1), (2, 3, 7), (2, 4, 64), (1, 2, 100),
                                     (1, 2, 1024), (1, 1, LIMIT)])
def test_causal_softmax(dtype, b, np_, s):
    torch.manual_seed(s)
    x = (torch.randn(b, np_, s, s, device="cuda") * 4).to(dtype)
    g = torch.randn_like(x)
    assert fused.softmax_kernel_for(x, True) == fused.UPPER_TRIANG
    y, (dx,) = run(lambda t: fused.attention_softmax(t, scale=0.37, causal=True), [x], g)
    y_ref, (dx_ref,) = reference_softmax(x, 0.37, True, None, g)
    assert y.dtype == dtype
    assert rel_err(y, y_ref) < TOLERANCE[dtype] and rel_err(dx, dx_ref) < TOLERANCE[dtype]
    future = torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1)
    assert (y[..., future] == 0).all() and (dx[..., future] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,mask_shape,causal", [
    ((2, 3, 5, 29), (2, 1, 5, 29), False),
    ((2, 3, 17, 16), (1, 1, 17, 16), True),
    ((1, 2, 8, 300), (1, 1, 1, 300), False),
    ((2, 2, 3, 2000), (2, 1, 3, 2000), False),
    ((1, 1, 2, 8), None, True),  # sq != sk
])
def test_masked_softmax(dtype, shape, mask_shape, causal):
    torch.manual_seed(sum(shape))
    x = (torch.randn(shape, device="cuda") * 4).to(dtype)
    g = torch.randn_like(x)
    mask = None
    if mask_shape is not None:
        mask = torch.rand(mask_shape, device="cuda") < 0.4
        mask[0, 0, 0] = True  # a fully masked row
    assert fused.softmax_kernel_for(x, causal, mask) == fused.MASKED
    y, (dx,) = run(lambda t: fused.attention_softmax(t, scale=0.5, causal=causal, mask=mask),
                   [x], g)
    y_ref, (dx_ref,) = reference_softmax(x, 0.5, causal, mask, g)
    assert rel_err(y, y_ref) < TOLERANCE[dtype] and rel_err(dx, dx_ref) < TOLERANCE[dtype]


def test_rows_over_the_limit_take_the_plain_path():
    x = torch.randn(1, 1, 2, LIMIT + 1, device="cuda", requires_grad=True)
    assert fused.softmax_kernel_for(x, False) is None
    y = fused.attention_softmax(x, scale=1.0, causal=False)
    assert "ScaledMaskedSoftmax" not in type(y.grad_fn).__name__
    xl = torch.randn(4, LIMIT + 1, device="cuda")
    w, b = torch.ones(LIMIT + 1, device="cuda"), torch.zeros(LIMIT + 1, device="cuda")
    assert not fused.layer_norm_fusable(xl, w, b)
    assert not fused.rms_norm_fusable(xl, w)
    y = fused.rms_norm(xl.detach().requires_grad_(), w, 1e-5)
    assert "FusedRMSNorm" not in type(y.grad_fn).__name__


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 3), (3, 7, 130), (300, 1024), (4, 5000), (16, LIMIT)])
def test_layer_norm(dtype, shape):
    torch.manual_seed(shape[-1])
    hidden = shape[-1]
    x = (torch.randn(shape, device="cuda") * 2 + 0.5).to(dtype)
    w = (torch.rand(hidden, device="cuda") + 0.5).to(dtype)
    b = torch.randn(hidden, device="cuda").to(dtype)
    g = torch.randn(shape, device="cuda").to(dtype)
    assert fused.layer_norm_fusable(x, w, b)
    y, grads = run(lambda *t: fused.fused_layer_norm(*t, 1e-5), [x, w, b], g)
    y_ref, grads_ref = run(
        lambda *t: torch.nn.functional.layer_norm(t[0], (hidden,), t[1], t[2], 1e-5),
        [x.float(), w.float(), b.float()], g.float())
    assert rel_err(y, y_ref) < TOLERANCE[dtype]
    for got, want in zip(grads, grads_ref):
        assert got.dtype == dtype and rel_err(got, want) < TOLERANCE[dtype]


def test_norms_take_the_cuda_rule():
    """On CUDA layer norm takes F.layer_norm and RMSNorm our kernel (norms.CUDA_RULE, as
    gpu_check.sh measured them); the mode `ours` still forces our layer norm."""
    from megatron.fused import choice, norms
    x = torch.randn(8, 1024, device="cuda", requires_grad=True)
    w, b = torch.ones(1024, device="cuda"), torch.zeros(1024, device="cuda")
    assert fused.layer_norm_fusable(x, w, b) and fused.rms_norm_fusable(x, w)
    assert fused.layer_norm_preferred(x, w, b) is norms.CUDA_RULE["layer_norm"] is False
    assert "FusedRMSNorm" in type(fused.rms_norm(x, w, 1e-5).grad_fn).__name__
    choice.set_mode("ours")
    try:
        assert fused.layer_norm_preferred(x, w, b)
    finally:
        choice.set_mode(None)


def test_layer_norm_grads_deterministic_and_stream_aware():
    torch.manual_seed(0)
    x, g = torch.randn(1000, 768, device="cuda"), torch.randn(1000, 768, device="cuda")
    w, b = torch.rand(768, device="cuda"), torch.randn(768, device="cuda")
    first = run(lambda *t: fused.fused_layer_norm(*t, 1e-5), [x, w, b], g)[1]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        second = run(lambda *t: fused.fused_layer_norm(*t, 1e-5), [x, w, b], g)[1]
    torch.cuda.synchronize()
    for a, b_ in zip(first, second):
        assert torch.equal(a, b_)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 3), (3, 7, 130), (300, 1024), (4, 5000), (16, LIMIT)])
def test_rms_norm(dtype, shape):
    torch.manual_seed(shape[-1])
    hidden = shape[-1]
    x = (torch.randn(shape, device="cuda") * 2 + 0.5).to(dtype)
    w = (torch.rand(hidden, device="cuda") + 0.5).to(dtype)
    g = torch.randn(shape, device="cuda").to(dtype)
    assert fused.rms_norm_fusable(x, w)
    assert "FusedRMSNorm" in type(
        fused.rms_norm(x.detach().requires_grad_(), w, 1e-5).grad_fn).__name__
    y, grads = run(lambda *t: fused.rms_norm(*t, 1e-5), [x, w], g)
    y_ref, grads_ref = run(lambda *t: fused.rms_norm(*t, 1e-5, fusion=False),
                           [x.float(), w.float()], g.float())
    assert y.dtype == dtype and rel_err(y, y_ref) < TOLERANCE[dtype]
    for got, want in zip(grads, grads_ref):
        assert got.dtype == dtype and rel_err(got, want) < TOLERANCE[dtype]
    if dtype != torch.float32:  # rounded before the weight, as the plain path
        assert (y != fused.rms_norm(x.detach(), w, 1e-5, fusion=False)).float().mean() < 0.01


def test_rms_norm_grads_deterministic_and_stream_aware():
    torch.manual_seed(0)
    x, g = torch.randn(1000, 768, device="cuda"), torch.randn(1000, 768, device="cuda")
    w = torch.rand(768, device="cuda")
    first = run(lambda *t: fused.rms_norm(*t, 1e-5), [x, w], g)[1]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        second = run(lambda *t: fused.rms_norm(*t, 1e-5), [x, w], g)[1]
    torch.cuda.synchronize()
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_softmax_on_a_side_stream():
    x = torch.randn(2, 4, 128, 128, device="cuda")
    expected = fused.attention_softmax(x, scale=0.5, causal=True, fusion=False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y = fused.attention_softmax(x, scale=0.5, causal=True)
    torch.cuda.synchronize()
    assert rel_err(y, expected) < 1e-6
