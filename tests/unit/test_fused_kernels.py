"""Fused softmax / layer-norm / RMSNorm CPU kernels against the plain PyTorch reference.

The first run compiles the CPU extension (a minute or two, cached afterwards in
~/.cache/megatron_fused or $MEGATRON_FUSED_BUILD_DIR). Outputs are poisoned with
NaN before every kernel call, so an element a kernel forgets to write fails. The attention
kernel's tests are in test_fused_attention.py, the build and loading in test_fused_build.py.
"""
import pytest
import torch

from megatron import fused
from megatron.fused import norms, paths
from tests.fused_checks import (DTYPES, TOLERANCE, kernels,  # noqa: F401 (loads them)
                                outputs_and_grads, rel_err)

LOW_PRECISION = (torch.bfloat16, torch.float16)


def reference_softmax(x, scale, causal, mask, grad):
    """Plain path in float32 on the same input values: (probs, d probs / d x)."""
    xr = x.detach().float().requires_grad_()
    y = fused.attention_softmax(xr, scale=scale, causal=causal, mask=mask, fusion=False)
    y.backward(grad.float())
    return y.detach(), xr.grad


# ------------------------------------------------------------------------ softmax

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batches,sq", [(1, 1), (3, 7), (2, 64), (4, 100)])
def test_upper_triang_softmax(dtype, batches, sq):
    torch.manual_seed(sq)
    x = (torch.randn(batches, sq, sq) * 4).to(dtype)
    g = torch.randn(batches, sq, sq).to(dtype)
    y, (dx,) = outputs_and_grads(
        lambda t: fused.ScaledUpperTriangMaskedSoftmax.apply(t, 0.37), [x], g)
    y_ref, dx_ref = reference_softmax(x.view(batches, 1, sq, sq), 0.37, True, None, g.view(
        batches, 1, sq, sq))
    assert y.dtype == dtype and dx.dtype == dtype
    assert rel_err(y, y_ref.view_as(y)) < TOLERANCE[dtype]
    assert rel_err(dx, dx_ref.view_as(dx)) < TOLERANCE[dtype]
    future = torch.ones(sq, sq, dtype=torch.bool).triu(1)
    assert (y[:, future] == 0).all() and (dx[:, future] == 0).all()
    assert torch.allclose(y.float().sum(-1), torch.ones(batches, sq), atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,mask_b,mask_dtype", [
    ((2, 3, 5, 29), 2, torch.bool),
    ((2, 3, 17, 16), 1, torch.bool),
    ((1, 2, 8, 200), 1, torch.uint8),
    ((3, 1, 4, 1), 3, torch.bool),
])
def test_masked_softmax(dtype, shape, mask_b, mask_dtype):
    torch.manual_seed(sum(shape))
    b, np_, sq, sk = shape
    x = (torch.randn(shape) * 4).to(dtype)
    g = torch.randn(shape).to(dtype)
    mask = torch.rand(mask_b, 1, sq, sk) < 0.4
    mask[0, 0, 0] = True  # one fully masked row: uniform output, zero gradient
    y, (dx,) = outputs_and_grads(
        lambda t: fused.ScaledMaskedSoftmax.apply(t, mask.to(mask_dtype), 0.5), [x], g)
    y_ref, dx_ref = reference_softmax(x, 0.5, False, mask, g)
    assert rel_err(y, y_ref) < TOLERANCE[dtype]
    assert rel_err(dx, dx_ref) < TOLERANCE[dtype]
    assert (dx.expand(shape)[mask.expand(shape)] == 0).all()
    assert torch.allclose(y[0, :, 0].float(), torch.full((np_, sk), 1.0 / sk), atol=1e-2)


def test_float32_matches_plain_path_exactly_enough():
    """float32: both the kernel and the plain path run in float32; < 1e-6 apart."""
    torch.manual_seed(0)
    x, g = torch.randn(2, 4, 48, 48) * 3, torch.randn(2, 4, 48, 48)
    for causal, mask in [(True, None), (False, torch.rand(2, 1, 48, 48) < 0.2)]:
        y, (dx,) = outputs_and_grads(
            lambda t: fused.attention_softmax(t, scale=0.3, causal=causal, mask=mask), [x], g)
        y_ref, (dx_ref,) = outputs_and_grads(lambda t: fused.attention_softmax(
            t, scale=0.3, causal=causal, mask=mask, fusion=False), [x], g)
        assert rel_err(y, y_ref) < 1e-6 and rel_err(dx, dx_ref) < 1e-6


B, NP, SQ, SK = 2, 3, 6, 6
DISPATCH_CASES = [
    # (scores shape, dtype, causal, mask shape, mask dtype, expected kernel)
    ((B, NP, SQ, SK), torch.float32, True, None, None, fused.UPPER_TRIANG),
    ((B, NP, SQ, SK), torch.bfloat16, True, None, None, fused.UPPER_TRIANG),
    ((B, NP, 2, SK), torch.float32, True, None, None, fused.MASKED),  # sq != sk (KV cache)
    ((B, NP, SQ, SK), torch.float32, False, None, None, fused.MASKED),
    ((B, NP, SQ, SK), torch.float32, True, (B, 1, SQ, SK), torch.bool, fused.MASKED),
    ((B, NP, SQ, SK), torch.float16, False, (B, 1, 1, SK), torch.bool, fused.MASKED),
    ((B, NP, SQ, SK), torch.float32, False, (SQ, SK), torch.uint8, fused.MASKED),
    # fail the fast-path constraints: plain PyTorch
    ((B, NP, SQ, SK), torch.float32, False, (B, NP, SQ, SK), torch.bool, None),  # per head
    ((B, NP, SQ, SK), torch.float64, True, None, None, None),
    ((B, NP, SQ, SK), torch.float32, False, (B, 1, SQ, SK), torch.float32, None),
    ((0, NP, SQ, SK), torch.float32, True, None, None, None),
]


@pytest.mark.parametrize("shape,dtype,causal,mask_shape,mask_dtype,kernel", DISPATCH_CASES)
def test_attention_softmax_dispatch(shape, dtype, causal, mask_shape, mask_dtype, kernel):
    torch.manual_seed(1)
    x = torch.randn(shape).to(dtype)
    mask = None if mask_shape is None else (torch.rand(mask_shape) < 0.3).to(mask_dtype)
    assert fused.softmax_kernel_for(x, causal, mask) == kernel
    if mask is not None and mask.dtype == torch.float32:
        return  # not a valid mask for the plain path either
    g = torch.randn(shape).to(dtype)
    y, (dx,) = outputs_and_grads(
        lambda t: fused.attention_softmax(t, scale=0.5, causal=causal, mask=mask), [x], g)
    if x.numel() == 0:
        return
    y_ref, dx_ref = reference_softmax(x, 0.5, causal, mask, g)
    tol = TOLERANCE.get(dtype, 1e-6)
    assert y.dtype == dtype and rel_err(y, y_ref) < tol and rel_err(dx, dx_ref) < tol


def test_fusion_false_takes_plain_path(monkeypatch):
    x = torch.randn(1, 2, 4, 4, requires_grad=True)
    fused_y = fused.attention_softmax(x, scale=1.0, causal=False, fusion=True)
    plain_y = fused.attention_softmax(x, scale=1.0, causal=False, fusion=False)
    assert "ScaledMaskedSoftmax" in type(fused_y.grad_fn).__name__
    assert "ScaledMaskedSoftmax" not in type(plain_y.grad_fn).__name__
    x = torch.randn(2, 3, 8, requires_grad=True)
    w, b = torch.ones(8, requires_grad=True), torch.zeros(8, requires_grad=True)
    monkeypatch.setattr(norms, "layer_norm_preferred", lambda x, w, b: True)  # as on CUDA
    assert "LayerNormFunction" in fused.layer_norm(x, w, b, 1e-5).grad_fn.name()  # C++ node
    plain = fused.layer_norm(x, w, b, 1e-5, fusion=False)
    assert "LayerNormFunction" not in plain.grad_fn.name()


# --------------------------------------------------------------------- layer norm

LAYER_NORM_KERNELS = {  # the CPU's C++ autograd node; the Python Function (CUDA's) on CPU
    "cpp_node": lambda *t: fused.fused_layer_norm(*t, 1e-5),
    "python_function": lambda *t: fused.FusedLayerNormAffine.apply(*t, 1e-5),
}


@pytest.mark.parametrize("kernel", sorted(LAYER_NORM_KERNELS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 3), (3, 7, 130), (64, 1024), (2, 3, 17), (600, 1024),
                                   (4, 5, 120), (6, 59)])
def test_layer_norm(kernel, dtype, shape):
    """Against float32 F.layer_norm of the same values; [600, 1024] outputs are >= 2 MiB
    in float32 (the huge-page output cache)."""
    torch.manual_seed(shape[-1])
    hidden = shape[-1]
    x = (torch.randn(shape) * 2 + 0.5).to(dtype)
    w = (torch.rand(hidden) + 0.5).to(dtype)
    b = torch.randn(hidden).to(dtype)
    g = torch.randn(shape).to(dtype)
    y, grads = outputs_and_grads(LAYER_NORM_KERNELS[kernel], [x, w, b], g)
    y_ref, grads_ref = outputs_and_grads(
        lambda *t: torch.nn.functional.layer_norm(t[0], (hidden,), t[1], t[2], 1e-5),
        [x.float(), w.float(), b.float()], g.float())
    assert y.dtype == dtype and y.shape == x.shape
    assert rel_err(y, y_ref) < TOLERANCE[dtype]
    for got, want in zip(grads, grads_ref):
        assert got.dtype == dtype and rel_err(got, want) < TOLERANCE[dtype]


def test_layer_norm_hidden_one():
    """hidden == 1: x - mean is 0, so y == bias and dx == 0 (up to rounding)."""
    x, w, b = torch.randn(5, 1) * 3, torch.full((1,), 2.0), torch.full((1,), 0.25)
    y, (dx, dw, db) = outputs_and_grads(
        lambda *t: fused.FusedLayerNormAffine.apply(*t, 1e-5), [x, w, b], torch.ones(5, 1))
    assert torch.equal(y, torch.full((5, 1), 0.25))
    assert dx.abs().max() < 1e-4 and dw.abs().max() < 1e-4 and db.item() == 5.0


def test_layer_norm_fallbacks_and_module():
    x = torch.randn(4, 8, dtype=torch.float64)
    w, b = torch.ones(8, dtype=torch.float64), torch.zeros(8, dtype=torch.float64)
    assert not fused.layer_norm_fusable(x, w, b)  # float64
    assert not fused.layer_norm_fusable(x.float(), None, None)  # no affine params
    assert not fused.layer_norm_fusable(x.bfloat16(), w.float(), b.float())  # mixed dtypes
    assert not fused.layer_norm_fusable(x.float(), w[:4].float(), b[:4].float())
    expected = torch.nn.functional.layer_norm(x, (8,), w, b, 1e-5)
    assert torch.allclose(fused.layer_norm(x, w, b, 1e-5), expected)

    # on a CPU: our kernel whenever it applies (bench_fused: at least as fast as F.layer_norm
    # on AVX2 and AVX-512, float32 and bfloat16)
    for dtype in (torch.float32, torch.bfloat16):
        assert fused.layer_norm_preferred(x.to(dtype), w.to(dtype), b.to(dtype))
    assert not fused.layer_norm_preferred(x, w, b)  # float64: not fusable
    ln = fused.LayerNorm(16, eps=1e-6, sequence_parallel=True)
    assert ln.weight.sequence_parallel and ln.bias.sequence_parallel
    out = ln(torch.randn(3, 2, 16))
    assert "LayerNormFunction" in out.grad_fn.name()
    assert "NativeLayerNorm" in type(fused.LayerNorm(16, fusion=False)(
        torch.randn(3, 2, 16)).grad_fn).__name__
    out.sum().backward()
    assert ln.weight.grad.shape == (16,) and torch.isfinite(ln.weight.grad).all()


# ------------------------------------------------------------------------ RMSNorm

def rms_norm_kernel(x, w):
    return fused.FusedRMSNormAffine.apply(x, w, 1e-5)


def rms_norm_plain(x, w):
    return fused.rms_norm(x, w, 1e-5, fusion=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 3), (3, 7, 130), (64, 1024), (2, 3, 17), (4, 5, 120)])
def test_rms_norm(dtype, shape):
    """Outputs and grads against the plain path in float32; for 16-bit inputs the
    output also equals the plain path's in that dtype (same two roundings)."""
    torch.manual_seed(shape[-1])
    hidden = shape[-1]
    x = (torch.randn(shape) * 2 + 0.5).to(dtype)
    w = (torch.rand(hidden) + 0.5).to(dtype)
    g = torch.randn(shape).to(dtype)
    y, grads = outputs_and_grads(rms_norm_kernel, [x, w], g)
    y_ref, grads_ref = outputs_and_grads(rms_norm_plain, [x.float(), w.float()], g.float())
    assert y.dtype == dtype and y.shape == x.shape
    assert rel_err(y, y_ref) < TOLERANCE[dtype]
    for got, want in zip(grads, grads_ref):
        assert got.dtype == dtype and got.shape == want.shape
        assert rel_err(got, want) < TOLERANCE[dtype]
    if dtype != torch.float32:
        # x * rstd is rounded to dtype before the weight, as in the plain path: the outputs
        # agree but where rstd's last bit differs (one rounding instead of two would
        # differ in about a quarter of the elements).
        assert (y != rms_norm_plain(x, w)).float().mean() < 0.01


def test_rms_norm_matches_hugging_face_formula():
    """weight * (x * rsqrt(mean(x^2) + eps)) computed in float32, cast before the weight."""
    torch.manual_seed(0)
    x, w = torch.randn(6, 40).bfloat16(), (torch.rand(40) + 0.5).bfloat16()
    xf = x.float()
    expected = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    for fusion in (True, False):
        out = fused.rms_norm(x, w, 1e-6, fusion=fusion)
        assert out.dtype == torch.bfloat16
        assert (out.float() - expected.float()).abs().max() <= 2**-7 * expected.abs().max()


def test_rms_norm_hidden_one():
    """hidden == 1: y = w * x / sqrt(x^2 + eps) ~ w * sign(x), so dx ~ 0 and dw = sum(sign(x))."""
    x, w = torch.tensor([[3.0], [-2.0], [5.0]]), torch.full((1,), 2.0)
    y, (dx, dw) = outputs_and_grads(rms_norm_kernel, [x, w], torch.ones(3, 1))
    assert torch.allclose(y, torch.tensor([[2.0], [-2.0], [2.0]]), atol=1e-5)
    assert dx.abs().max() < 1e-5 and abs(dw.item() - 1.0) < 1e-5


def test_rms_norm_fallbacks_and_module():
    x, w = torch.randn(4, 8, dtype=torch.float64), torch.rand(8, dtype=torch.float64)
    assert not fused.rms_norm_fusable(x, w)  # float64
    assert not fused.rms_norm_fusable(x.float(), None)
    assert not fused.rms_norm_fusable(x.bfloat16(), w.float())  # mixed dtypes
    assert not fused.rms_norm_fusable(x.float(), w[:4].float())
    assert fused.rms_norm_fusable(x.float(), w.float())
    out = fused.rms_norm(x, w, 1e-5)  # float64 takes the plain path
    assert out.dtype == torch.float64
    assert torch.allclose(out, w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))

    for sequence_parallel in (False, True):
        norm = fused.RMSNorm(16, eps=1e-6, sequence_parallel=sequence_parallel)
        assert [name for name, _ in norm.named_parameters()] == ["weight"]
        assert norm.weight.sequence_parallel is sequence_parallel
        assert torch.equal(norm.weight.detach(), torch.ones(16)) and norm.eps == 1e-6
    out = norm(torch.randn(3, 2, 16))
    assert "FusedRMSNorm" in type(out.grad_fn).__name__
    out.sum().backward()
    assert norm.weight.grad.shape == (16,) and torch.isfinite(norm.weight.grad).all()
    plain = fused.RMSNorm(16, fusion=False)(torch.randn(3, 16))
    assert "FusedRMSNorm" not in type(plain.grad_fn).__name__


def test_rms_norm_drops_in_for_layer_norm_init():
    """layer_norm_init_attributes (what the transformer calls on its norms) accepts RMSNorm."""
    from megatron.mpu.layers import layer_norm_init_attributes
    norm = fused.RMSNorm(8)
    layer_norm_init_attributes(norm)
    assert norm.weight.tensor_model_parallel is False
    torch.nn.init.zeros_(norm.weight)
    norm.weight.init_method(norm.weight.data)
    assert torch.equal(norm.weight.detach(), torch.ones(8))


# ------------------------------------------------------- bias-GeLU, cross entropy

def plain_bias_gelu(y, bias=None):
    return torch.nn.functional.gelu(y.float() if bias is None else y.float() + bias.float(),
                                    approximate="tanh")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 3), (3, 7, 130), (64, 1024), (2, 3, 17)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_gelu_kernel(dtype, shape, with_bias):
    torch.manual_seed(0)
    y = (3 * torch.randn(shape)).to(dtype)
    bias = torch.randn(shape[-1]).to(dtype) if with_bias else None
    grad = torch.randn(shape).to(dtype)
    inputs = [y, bias] if with_bias else [y]
    assert fused.bias_gelu_fusable(y, bias)
    out, grads = outputs_and_grads(lambda *t: fused.FusedBiasGeLU.apply(t[0], t[1] if with_bias else None),
                                   inputs, grad)
    # The reference in float64 from the same (rounded) inputs.
    ref_out, ref_grads = outputs_and_grads(
        lambda *t: plain_bias_gelu(*t).to(torch.float64), [t.double() for t in inputs],
        grad.double())
    tol = TOLERANCE[dtype]
    assert rel_err(out, ref_out) < tol
    for g, ref in zip(grads, ref_grads):
        assert rel_err(g, ref) < 10 * tol


def test_bias_gelu_dispatch_and_extremes():
    y, bias = torch.tensor([[-100.0, -10.0, -1e-3, 0.0, 1e-3, 10.0, 100.0]]), torch.zeros(7)
    out = fused.bias_gelu(bias, y)
    assert torch.allclose(out, plain_bias_gelu(y), rtol=1e-6, atol=1e-7)
    assert abs(out[0, 0]) < 1e-30 and out[0, -1] == 100.0
    assert not fused.bias_gelu_fusable(y.double(), None)
    assert not fused.bias_gelu_fusable(y, torch.zeros(6))
    assert torch.allclose(fused.bias_gelu(bias, y, fusion=False), plain_bias_gelu(y))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("given_max", [False, True])
def test_exp_sum_kernel(dtype, given_max):
    torch.manual_seed(0)
    x = (4 * torch.randn(37, 1003)).to(dtype)
    x[:, 900:] = float("-inf")  # vocabulary padding
    row_max = x.float().amax(dim=-1) + 0.5 if given_max else None
    kernel_x, plain_x = x.clone(), x.float()
    m, s = fused.exp_sum_(kernel_x, row_max)
    m_ref, s_ref = fused.exp_sum_(plain_x, row_max, fusion=False)
    assert m.dtype == s.dtype == torch.float32
    assert torch.equal(m, m_ref)
    assert rel_err(s, s_ref) < TOLERANCE[dtype]
    assert rel_err(kernel_x.float(), plain_x) < TOLERANCE[dtype]
    assert (kernel_x[:, 900:] == 0).all()


def test_add_to_float_same_bits_as_add():
    """The reducer's bfloat16 gradient into its float32 main_grad: the kernel's bits are
    add_'s (lengths with and without a vector tail, values that round); anything the kernel
    does not take falls back to add_."""
    torch.manual_seed(0)
    kernel = paths.fused_kernels.get_extension("cpu")
    assert hasattr(kernel, "add_to_float_")
    for shape in [(8064, 256), (17,), (3, 1000003 // 3), (1,)]:
        acc, x = 1e3 * torch.randn(shape), torch.randn(shape).bfloat16()
        want = acc.clone().add_(x)
        got = acc.clone()
        assert fused.add_to_float_(got, x) is got and torch.equal(got, want)
    acc, x = torch.randn(64, 32), torch.randn(32, 64).bfloat16()
    for a, b in [(acc, x.t()), (acc.t(), x), (acc, x.t().float())]:
        want = a.clone().add_(b)
        got = a.clone()
        assert torch.equal(fused.add_to_float_(got, b), want)
    with pytest.raises(RuntimeError, match="use acc.add_"):
        kernel.add_to_float_(acc, x.float().bfloat16().view(-1)[:100])


# ------------------------------------------------------------ thread counts

THREAD_CASES = {  # kernel, input shapes, output-gradient shape
    "layer_norm": (lambda x, w, b: fused.fused_layer_norm(x, w, b, 1e-5),
                   [(300, 96), (96,), (96,)], (300, 96)),
    "rms_norm": (rms_norm_kernel, [(300, 96), (96,)], (300, 96)),
    "bias_gelu": (fused.FusedBiasGeLU.apply, [(300, 96), (96,)], (300, 96)),
    "causal_attention": (lambda q, k, v: fused.FusedCausalAttention.apply(q, k, v, 0.2),
                         [(40, 3, 5, 32)] * 3, (40, 3, 5, 32)),
    "causal_attention_dropout": (
        lambda q, k, v: fused.FusedCausalAttention.apply(q, k, v, 0.2, 0.1, 7),
        [(40, 3, 5, 32)] * 3, (40, 3, 5, 32)),
}


@pytest.mark.parametrize("case", sorted(THREAD_CASES))
def test_results_independent_of_thread_count(case):
    """Parameter gradients summed over rows (and attention's per-head tasks, claimed by
    whichever thread is free) come out bit-identical on 1, 2 and 3 threads."""
    fn, shapes, grad_shape = THREAD_CASES[case]
    torch.manual_seed(0)
    tensors, grad = [torch.randn(shape) for shape in shapes], torch.randn(grad_shape)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(outputs_and_grads(fn, tensors, grad))
    finally:
        torch.set_num_threads(threads)
    out1, grads1 = results[0]
    for out, grads in results[1:]:
        assert torch.equal(out1, out)
        for a, b_ in zip(grads1, grads):
            assert torch.equal(a, b_)


# -------------------------------------------------------- element-wise (plain)

def test_bias_gelu_and_bias_dropout_add():
    y, bias = torch.randn(4, 8), torch.randn(8)
    expected = torch.nn.functional.gelu(y + bias, approximate="tanh")
    assert torch.allclose(fused.bias_gelu(bias, y), expected, rtol=1e-5, atol=1e-6)
    x, residual = torch.randn(4, 8), torch.randn(4, 8)
    assert torch.allclose(fused.bias_dropout_add(x, bias, residual, 0.5, False),
                          residual + x + bias)
    out = fused.bias_dropout_add(x, None, residual, 1.0, True)
    assert torch.equal(out, residual)


def test_fast_cpu_dropout_statistics_gradient_and_reproducibility():
    x = torch.randn(256, 512, requires_grad=True)
    torch.manual_seed(7)
    y = fused.dropout(x, 0.25, training=True, fusion=True)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.75) < 0.01
    torch.testing.assert_close(y[kept], x[kept] / 0.75)
    y.sum().backward()
    torch.testing.assert_close(x.grad, kept.float() / 0.75)
    torch.manual_seed(7)  # same generator state, same mask: recomputation reproduces it
    assert torch.equal(fused.dropout(x, 0.25, training=True, fusion=True), y)
    assert torch.equal(fused.dropout(x, 0.25, training=False, fusion=True), x)
    assert torch.count_nonzero(fused.dropout(x, 1.0, training=True, fusion=True)) == 0


def test_norm_paths_are_announced_once(capsys, monkeypatch):
    """The log names the path each norm takes, once per path: our kernel with the CPU's
    instruction set, or the plain path and why."""
    monkeypatch.setattr(paths, "_ANNOUNCED", set())
    x, w, b = torch.randn(4, 8), torch.ones(8), torch.zeros(8)
    for _ in range(2):
        fused.layer_norm(x, w, b, 1e-5)
        fused.layer_norm(x, w, b, 1e-5, fusion=False)
        fused.layer_norm(x.double(), w.double(), b.double(), 1e-5)
        fused.rms_norm(x, w, 1e-5)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f" layer norm: our CPU kernel, {fused.cpu_kernels_isa()}",
        " layer norm: F.layer_norm (fusion off)",
        " layer norm: F.layer_norm (float64 [..., 8] outside the kernel's constraints)",
        f" RMSNorm: our CPU kernel, {fused.cpu_kernels_isa()}",
    ], lines
