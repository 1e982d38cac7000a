"""The CPU causal-attention kernel (flash-attention style, dropout inside, the full blocks of
ring attention) against SDPA and the explicit path."""
import json
import os

import pytest
import torch

from megatron import fused
from megatron.fused import attention as fused_attention
from megatron.fused.attention import outside_window
from tests.fused_checks import (explicit_attention, kernels,  # noqa: F401 (loads them)
                                outputs_and_grads, rel_err)

def sdpa_attention(q, k, v):
    """Reference: torch's SDPA on [b, heads, s, d] views, back to [s, b, heads * d]."""
    s, b, heads, dim = q.shape
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True)
    return out.permute(2, 0, 1, 3).reshape(s, b, heads * dim)


@pytest.mark.parametrize("s,b,heads,dim", [(256, 2, 4, 32), (13, 2, 3, 16), (37, 1, 2, 64),
                                           (100, 3, 2, 48), (1, 1, 1, 16)])
def test_causal_attention_kernel_matches_sdpa(s, b, heads, dim):
    """q, k, v as the strided views of one fused QKV projection, as the model passes them."""
    torch.manual_seed(s)
    qkv, grad = torch.randn(s, b, heads, 3 * dim), torch.randn(s, b, heads * dim)
    results = []
    for attention in (sdpa_attention,
                      lambda q, k, v: fused.causal_attention(q, k, v, dim ** -0.5)):
        out, (dqkv,) = outputs_and_grads(lambda x: attention(*x.split(dim, dim=-1)), [qkv], grad)
        results.append((out, dqkv))
    assert fused.causal_attention_fusable(*qkv.split(dim, dim=-1))
    (ref_out, ref_grad), (out, dqkv) = results
    assert rel_err(out, ref_out) < 2e-6
    assert rel_err(dqkv, ref_grad) < 5e-6


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_bfloat16_attention_widened_is_the_float32_kernel_rounded(monkeypatch, p):
    """bfloat16 q, k, v without the bfloat16 kernel (a CPU without AVX512-BF16, or the avx2
    build): the float32 kernel on their widened values, its output rounded to bfloat16 (bit
    for bit); gradients in bfloat16 within its rounding of the float32 ones, and as close to
    SDPA's float32 result as SDPA's own bfloat16 kernel is."""
    monkeypatch.setattr(fused_attention, "bf16_dot_products", lambda: False)
    s, b, heads, dim = 96, 2, 3, 32
    torch.manual_seed(0)
    qkv = torch.randn(s, b, heads, 3 * dim).bfloat16()
    grad = torch.randn(s, b, heads * dim).bfloat16()

    def kernel(x):
        return fused.causal_attention(*x.split(dim, dim=-1), dim ** -0.5, p, 1234)
    out, (dqkv,) = outputs_and_grads(kernel, [qkv], grad)
    assert out.dtype == dqkv.dtype == torch.bfloat16
    ref_out, (ref_dqkv,) = outputs_and_grads(kernel, [qkv.float()], grad.float())
    assert torch.equal(out, ref_out.bfloat16())
    assert rel_err(dqkv.float(), ref_dqkv) < 1e-2
    if p == 0.0:
        assert_as_close_as_sdpa_bf16(qkv, grad, out, dqkv, dim)


def assert_as_close_as_sdpa_bf16(qkv, grad, out, dqkv, dim, factor=1.5):
    """out and dqkv (bfloat16) are within `factor` times SDPA's bfloat16 error (+ 1e-3) of
    SDPA's float32 result on the same values."""
    sdpa = [outputs_and_grads(lambda x: sdpa_attention(*x.split(dim, dim=-1)), [x], g)
            for x, g in ((qkv, grad), (qkv.float(), grad.float()))]
    (sdpa_bf16, (sdpa_bf16_grad,)), (exact, (exact_grad,)) = sdpa
    assert rel_err(out.float(), exact) <= factor * rel_err(sdpa_bf16.float(), exact) + 1e-3
    assert (rel_err(dqkv.float(), exact_grad)
            <= factor * rel_err(sdpa_bf16_grad.float(), exact_grad) + 1e-3)


needs_bf16_dot = pytest.mark.skipif(
    not fused_attention.bf16_dot_products(),
    reason="the bfloat16 attention kernel needs AVX512-BF16 and the avx512 build")


@needs_bf16_dot
@pytest.mark.parametrize("s,dim", [(96, 32), (300, 64), (77, 48)])
def test_bfloat16_attention_kernel_is_as_close_as_sdpa_bf16(kernels, s, dim):
    """The AVX512-BF16 kernel (bfloat16 products, float32 sums): its output and gradients
    are bfloat16 and as close to SDPA's float32 result as SDPA's own bfloat16 kernel is."""
    torch.manual_seed(s)
    b, heads = 2, 3
    qkv = torch.randn(s, b, heads, 3 * dim).bfloat16()
    grad = torch.randn(s, b, heads * dim).bfloat16()
    out, (dqkv,) = outputs_and_grads(
        lambda x: fused.causal_attention(*x.split(dim, dim=-1), dim ** -0.5), [qkv], grad)
    assert out.dtype == dqkv.dtype == torch.bfloat16
    assert_as_close_as_sdpa_bf16(qkv, grad, out, dqkv, dim)


def test_causal_attention_dispatch():
    q = torch.randn(8, 1, 2, 32)
    assert fused.causal_attention_fusable(q, q, q)
    assert not fused.causal_attention_fusable(q.double(), q.double(), q.double())
    assert not fused.causal_attention_fusable(q.half(), q.half(), q.half())
    bf16 = q.bfloat16()  # widened at the kernel's edges, in training; ring blocks: float32 only
    assert fused.causal_attention_fusable(bf16, bf16, bf16)
    assert not fused.causal_attention_fusable(bf16, bf16, bf16, dtypes=(torch.float32,))
    assert not fused.causal_attention_fusable(bf16, q, q)
    odd = torch.randn(8, 1, 2, 24)
    assert not fused.causal_attention_fusable(odd, odd, odd)  # head_dim % 16
    longer = torch.randn(9, 1, 2, 32)
    assert not fused.causal_attention_fusable(q, longer, longer)  # a KV cache: sk > sq
    strided = torch.randn(8, 1, 2, 64)[..., ::2]
    assert not fused.causal_attention_fusable(strided, strided, strided)


@pytest.mark.parametrize("s,b,heads,dim,p", [(37, 2, 3, 16, 0.3), (100, 1, 2, 48, 0.1),
                                             (130, 2, 2, 64, 0.5), (1, 1, 1, 16, 0.2)])
def test_attention_dropout_matches_explicit_path_with_the_same_mask(s, b, heads, dim, p):
    """The kernel's dropout (forward and the backward's regenerated mask) equals the
    explicit softmax(q k^T) * keep / (1 - p) v with the kernel's own mask."""
    torch.manual_seed(s)
    qkv, grad = torch.randn(s, b, heads, 3 * dim), torch.randn(s, b, heads * dim)
    seed = 987654321 + s
    keep = fused.attention_dropout_keep(b * heads, s, p, seed)
    split = lambda x: x.split(dim, dim=-1)  # noqa: E731
    out, (dqkv,) = outputs_and_grads(
        lambda x: fused.causal_attention(*split(x), dim ** -0.5, p, seed), [qkv], grad)
    ref, (ref_dqkv,) = outputs_and_grads(
        lambda x: explicit_attention(*split(x), dim ** -0.5, True, keep, p), [qkv], grad)
    assert rel_err(out, ref) < 2e-6
    assert rel_err(dqkv, ref_dqkv) < 5e-6
    if s > 1:  # dropout is active: another seed gives another output
        other = fused.causal_attention(*split(qkv), dim ** -0.5, p, seed + 1)
        assert not torch.equal(other, out)


def test_attention_dropout_mask_statistics_and_determinism():
    """keep-probability 1 - p per row and overall, no correlation between neighbours,
    heads or seeds; the same seed gives the same mask; kept probabilities are scaled by
    1 / (1 - p), so the dropped rows still sum to 1 in expectation."""
    p, tasks, s = 0.1, 16, 512
    keep = fused.attention_dropout_keep(tasks, s, p, 7).float()
    assert abs(keep.mean().item() - (1 - p)) < 0.002  # 4M draws: sd 1.5e-4
    row_sd = (p * (1 - p) / s) ** 0.5
    assert keep.mean(-1).std().item() < 1.2 * row_sd  # rows are binomial, not clumped
    assert (keep.mean(-1) - (1 - p)).abs().max().item() < 6 * row_sd

    def corr(a, b):
        a, b = a - a.mean(), b - b.mean()
        return ((a * b).mean() / (a.std() * b.std())).item()
    assert abs(corr(keep[..., 1:], keep[..., :-1])) < 0.01  # neighbouring keys
    assert abs(corr(keep[1:], keep[:-1])) < 0.01  # heads
    assert abs(corr(keep, fused.attention_dropout_keep(tasks, s, p, 8).float())) < 0.01
    assert torch.equal(fused.attention_dropout_keep(tasks, s, p, 7).float(), keep)
    assert abs(fused.attention_dropout_keep(4, 256, 0.5, 3).float().mean().item() - 0.5) < 0.01
    assert fused.attention_dropout_keep(2, 8, 0.0, 3).all()
    # the output is unbiased: E[dropped p v] = p v; with v = 1 each output is a row sum
    q = torch.randn(64, 4, 8, 16)
    v = torch.ones_like(q)
    outs = torch.stack([fused.causal_attention(q, q, v, 0.25, 0.3, seed) for seed in range(40)])
    assert abs(outs.mean().item() - 1.0) < 0.01
    with pytest.raises(RuntimeError, match="attention dropout must be in"):
        fused.causal_attention(q, q, v, 0.25, 1.0, 0)


def test_attention_dropout_seed_from_the_model_parallel_generator(monkeypatch):
    """CoreAttention in training draws the kernel's seed from the tensor-model-parallel
    RNG state (the tracker's fork), leaving the default generator alone; the mask is then
    the one fused.attention_dropout_keep gives for that seed, and recomputation under
    mpu.checkpoint reproduces it. The kernel is forced (`ours`): the rule leaves it on the
    baseline build."""
    from megatron.fused import choice
    monkeypatch.setenv(choice.MODE_ENV, "ours")
    from megatron.config import ModelConfig
    from megatron.model.attention import CoreAttention
    from megatron.mpu import checkpoint, get_rng_tracker, model_parallel_seed
    cfg = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=24,
                      max_position_embeddings=24, padded_vocab_size=64, attention_dropout=0.2)
    attention = CoreAttention(cfg, 1).train()
    q, k, v = (torch.randn(24, 2, 4, 16, requires_grad=True) for _ in range(3))
    assert fused.causal_attention_preferred(q, k, v, 0.2)
    model_parallel_seed(1, 0)
    tracker = get_rng_tracker().get_states()
    default = torch.get_rng_state()
    out = attention(q, k, v, None)
    assert torch.equal(torch.get_rng_state(), default)  # default generator untouched
    get_rng_tracker().set_states(tracker)
    with get_rng_tracker().fork():
        seed = fused.attention_dropout_seed()
    keep = fused.attention_dropout_keep(8, 24, 0.2, seed)
    assert not keep.all()
    torch.testing.assert_close(out, explicit_attention(q, k, v, 0.25, True, keep, 0.2),
                               rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    get_rng_tracker().set_states(tracker)
    recomputed = checkpoint(lambda a, b_, c: attention(a, b_, c, None), q, k, v)
    assert torch.equal(recomputed, out)
    for a, b_ in zip(torch.autograd.grad(recomputed.sum(), (q, k, v)), grads):
        assert torch.equal(a, b_)
    attention.eval()  # no dropout outside training
    torch.testing.assert_close(attention(q, k, v, None), explicit_attention(q, k, v, 0.25),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("s,b,heads,groups,dim", [(24, 2, 4, 4, 16), (40, 1, 4, 2, 32),
                                                  (7, 1, 2, 1, 16)])
def test_full_block_kernel_matches_explicit_path(s, b, heads, groups, dim):
    """The kernel's non-causal mode (the full blocks of ring attention, through
    context_parallel.block_forward / block_backward, k / v grouped) against the plain
    block path: outputs, log-sum-exps and gradients, for a merged lse and output as the
    ring passes them."""
    from megatron.model import context_parallel as cp
    torch.manual_seed(s)
    q = torch.randn(b, heads, s, dim)
    k, v = torch.randn(b, groups, s, dim), torch.randn(b, groups, s, dim)
    assert cp._use_kernel(q, cp._expand(k, heads), False, True)
    results = [cp.block_forward(q, k, v, 0.3, False, fusion) for fusion in (True, False)]
    (out, lse), (ref, ref_lse) = results
    assert rel_err(out, ref) < 2e-6 and rel_err(lse, ref_lse) < 1e-6
    # a merged row: this block and a causal one over other keys, as in the ring
    other = cp.block_forward(q, *(torch.randn(b, groups, s, dim) for _ in range(2)), 0.3, True,
                             False)
    merged_out, merged_lse = cp.merge(ref, ref_lse, *other)
    dout = torch.randn_like(q)
    grads = [cp.block_backward(q, k, v, merged_out, merged_lse, dout, 0.3, False, fusion)
             for fusion in (True, False)]
    for a, b_ in zip(*grads):
        assert a.shape == b_.shape and rel_err(a, b_) < 5e-6


@pytest.fixture
def small_caches(kernels):
    """Cache sizes so small that the kernels take blocks of 32 keys and a few query rows: every
    row group streams several key blocks (the online softmax, the backward's per-block dk /
    dv sums) at test sizes."""
    kernels.set_cpu_caches(4096, 16384)
    yield kernels
    kernels.set_cpu_caches(0, 0)


@pytest.mark.parametrize("s,dim,causal,p", [(100, 16, True, 0.0), (130, 64, True, 0.2),
                                            (77, 32, False, 0.0), (96, 48, False, 0.3)])
def test_tiled_attention_matches_explicit_path(small_caches, s, dim, causal, p):
    """With many key blocks per row: outputs, log-sum-exps and gradients of the kernel (causal
    or over all keys, with dropout of the same mask as untiled) against the explicit path."""
    rows, *keys = small_caches.attention_tiles(s, dim)
    assert rows < s and keys == [32, 32]
    torch.manual_seed(s)
    b, heads, seed = 2, 3, 4321 + s
    q, k, v = (torch.randn(s, b, heads, dim, requires_grad=True) for _ in range(3))
    keep = fused.attention_dropout_keep(b * heads, s, p, seed) if p else None
    ref = explicit_attention(q, k, v, 0.3, causal, keep, p).view(s, b, heads, dim)
    out, lse = small_caches.causal_attention_forward(q, k, v, 0.3, causal, p, seed)
    scores = torch.einsum("ibhd,jbhd->bhij", q, k) * 0.3
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    assert rel_err(out, ref) < 2e-6
    assert rel_err(lse, scores.logsumexp(-1).reshape(b * heads, s)) < 1e-6
    dout = torch.randn_like(out)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    grads = small_caches.causal_attention_backward(dout, *(t.detach() for t in (q, k, v)), out,
                                                   lse, 0.3, causal, p, seed)
    for grad, ref_grad in zip(grads, ref_grads):
        assert rel_err(grad, ref_grad) < 5e-6


def test_attention_blocks_follow_the_cache_sizes(kernels):
    """The blocks come from the caches read at start-up (sysfs, as lscpu shows them): a
    larger L2 gives larger blocks, a larger head size smaller ones, and no block exceeds the
    sequence (rounded to 32 keys)."""
    l1d, l2 = kernels.cpu_caches()
    index = "/sys/devices/system/cpu/cpu0/cache/index2"
    if os.path.exists(f"{index}/size") and open(f"{index}/level").read().strip() == "2":
        size = open(f"{index}/size").read().strip()
        assert l2 == int(size[:-1]) << {"K": 10, "M": 20}[size[-1]]
    assert l1d >= 4096 and l2 >= 65536
    try:
        kernels.set_cpu_caches(32 << 10, 256 << 10)
        small = kernels.attention_tiles(1 << 16, 64)
        kernels.set_cpu_caches(48 << 10, 2 << 20)
        large = kernels.attention_tiles(1 << 16, 64)
        assert all(a < b for a, b in zip(small, large)), (small, large)
        assert all(a >= b for a, b in zip(large, kernels.attention_tiles(1 << 16, 128)))
        assert kernels.attention_tiles(40, 64)[1:] == (64, 64)
        assert all(n % 32 == 0 for n in small[1:] + large[1:])
    finally:
        kernels.set_cpu_caches(0, 0)


def sink_attention(q, k, v, scale, sinks, keep=None, dropout_p=0.0):
    """Reference: softmax over [scale q k^T (causal), sink] per row, the sink's column dropped,
    in plain PyTorch (the kernel's dropout mask `keep` applied as in explicit_attention)."""
    s, b, heads, d = q.shape
    qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    scores = (qh @ kh.transpose(-1, -2) * scale).masked_fill(
        torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    sink = sinks.view(1, heads, 1, 1).expand(b, heads, s, 1).to(scores.dtype)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :s]
    if keep is not None:
        probs = probs * keep.view(b, heads, s, s) / (1.0 - dropout_p)
    return (probs @ vh).permute(2, 0, 1, 3).reshape(s, b, heads * d)


@pytest.mark.parametrize("s,dim,p,tiny", [(70, 32, 0.0, False), (70, 32, 0.0, True),
                                          (45, 16, 0.25, True), (1, 16, 0.0, False)])
def test_attention_sinks_match_softmax_over_scores_and_sink(kernels, s, dim, p, tiny):
    """causal_attention(..., sinks=): output and gradients of q, k, v and the sinks against an
    explicit softmax over [scores, sink] in float64, with several key blocks (tiny caches)
    or one, with dropout; large sinks (most weight on the sink) and small ones."""
    torch.manual_seed(s + dim)
    b, heads, seed = 2, 3, 99 + s
    qkv, grad = torch.randn(s, b, heads, 3 * dim), torch.randn(s, b, heads * dim)
    sinks = torch.tensor([-2.0, 0.5, 4.0])
    keep = fused.attention_dropout_keep(b * heads, s, p, seed) if p else None
    if tiny:
        kernels.set_cpu_caches(4096, 16384)
    try:
        out, (dqkv, dsinks) = outputs_and_grads(
            lambda x, w: fused.causal_attention(*x.split(dim, dim=-1), 0.2, p, seed, sinks=w),
            [qkv, sinks], grad)
    finally:
        kernels.set_cpu_caches(0, 0)
    ref, (ref_dqkv, ref_dsinks) = outputs_and_grads(
        lambda x, w: sink_attention(*x.split(dim, dim=-1), 0.2, w, keep, p),
        [qkv.double(), sinks.double()], grad.double())
    assert rel_err(out, ref.float()) < 2e-6
    assert rel_err(dqkv, ref_dqkv.float()) < 5e-6
    assert rel_err(dsinks, ref_dsinks.float()) < 5e-6
    plain = fused.causal_attention(*qkv.split(dim, dim=-1), 0.2, p, seed)
    assert not torch.allclose(plain, out)  # the sinks take weight
    with pytest.raises(ValueError, match=r"one logit per head, shape \(3,\)"):
        fused.causal_attention(*qkv.split(dim, dim=-1), 0.2, sinks=torch.zeros(2))


def window_attention(q, k, v, scale, window, sinks=None, keep=None, dropout_p=0.0):
    """Reference: softmax over scale q k^T where query i sees keys i - window < j <= i (with
    a sink column when `sinks`), the kernel's dropout mask `keep` applied, in plain PyTorch."""
    s, b, heads, d = q.shape
    qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    scores = (qh @ kh.transpose(-1, -2) * scale).masked_fill(
        outside_window(s, s, window, q.device), float("-inf"))
    if sinks is not None:
        sink = sinks.view(1, heads, 1, 1).expand(b, heads, s, 1).to(scores.dtype)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :s]
    else:
        probs = torch.softmax(scores, dim=-1)
    if keep is not None:
        probs = probs * keep.view(b, heads, s, s) / (1.0 - dropout_p)
    return (probs @ vh).permute(2, 0, 1, 3).reshape(s, b, heads * d)


@pytest.mark.parametrize("s,dim,window,p,tiny,with_sinks", [
    (70, 32, 8, 0.0, False, False), (70, 32, 8, 0.0, True, False),
    (130, 16, 40, 0.0, True, True), (97, 16, 1, 0.0, True, False),
    (100, 48, 33, 0.2, True, False), (45, 16, 5, 0.25, False, True),
    (40, 16, 64, 0.0, True, False)])
def test_sliding_window_matches_masked_softmax(kernels, s, dim, window, p, tiny, with_sinks):
    """causal_attention(..., window=): output and gradients against a softmax over the
    window's keys in float64, with many key blocks (tiny caches: blocks of 32 keys, so that
    whole blocks lie before a row group's window and rows of one group start in different
    blocks) or one, windows of 1 key to wider than the sequence, with dropout and sinks."""
    torch.manual_seed(s + window)
    b, heads, seed = 2, 3, 7 + s
    qkv, grad = torch.randn(s, b, heads, 3 * dim), torch.randn(s, b, heads * dim)
    sinks = torch.tensor([-2.0, 0.5, 4.0]) if with_sinks else None
    keep = fused.attention_dropout_keep(b * heads, s, p, seed) if p else None
    if tiny:
        kernels.set_cpu_caches(4096, 16384)
    inputs = [qkv] if sinks is None else [qkv, sinks]
    try:
        out, grads = outputs_and_grads(
            lambda x, w=None: fused.causal_attention(*x.split(dim, dim=-1), 0.2, p, seed, w,
                                                     window), inputs, grad)
    finally:
        kernels.set_cpu_caches(0, 0)
    ref, ref_grads = outputs_and_grads(
        lambda x, w=None: window_attention(*x.split(dim, dim=-1), 0.2, window, w, keep, p),
        [t.double() for t in inputs], grad.double())
    assert rel_err(out, ref.float()) < 2e-6
    for got, want in zip(grads, ref_grads):
        # a window of one key: q's gradient is 0 up to float32 rounding of p (dp - delta)
        assert rel_err(got, want.float()) < 5e-6 or window == 1 and got.abs().max() < 1e-5
    full = fused.causal_attention(*qkv.split(dim, dim=-1), 0.2, p, seed, sinks)
    assert torch.allclose(full, out) == (window >= s)  # the window hides keys unless it spans s


@needs_bf16_dot
@pytest.mark.parametrize("s,dim,window,p,tiny,with_sinks", [
    (1, 16, 0, 0.0, False, False), (37, 64, 0, 0.0, True, False), (130, 64, 0, 0.2, True, False),
    (100, 48, 33, 0.2, True, False), (130, 16, 40, 0.0, True, True), (45, 32, 5, 0.25, False, True),
    (257, 128, 0, 0.0, False, False), (97, 16, 1, 0.0, True, False)])
@pytest.mark.parametrize("brgemm", [False, True], ids=["dot", "brgemm"])
def test_bfloat16_kernel_within_bf16_rounding_of_float64(monkeypatch, kernels, s, dim, window, p,
                                                         tiny, with_sinks, brgemm):
    """The bfloat16 kernel against float64 on the same bfloat16 values, with many key blocks
    (tiny caches) or one, odd lengths, sliding windows, sinks and dropout (the same mask as
    in float32): output and gradients of q, k, v and the sinks within 1e-2 relative, and
    those of q, k, v within 2x (+ 2e-3) the error of the float32 kernel on the widened
    values, whose only rounding is that of its bfloat16 results. The tolerance: bfloat16 keeps 8 bits (relative
    rounding 2^-9 = 2e-3 per value); p and ds are rounded to bfloat16 before their products.
    Both ways of computing the products: our dot products and oneDNN's microkernels."""
    if brgemm and not kernels.attention_brgemm():
        pytest.skip("this torch's oneDNN has no bfloat16 microkernels")
    torch.manual_seed(s + dim)
    b, heads, seed = 2, 3, 11 + s
    qkv = torch.randn(s, b, heads, 3 * dim).bfloat16()
    grad = torch.randn(s, b, heads * dim).bfloat16()
    sinks = torch.tensor([-2.0, 0.5, 4.0]).bfloat16() if with_sinks else None
    inputs = [qkv] if sinks is None else [qkv, sinks]
    keep = fused.attention_dropout_keep(b * heads, s, p, seed) if p else None

    def run(x, w=None):
        return fused.causal_attention(*x.split(dim, dim=-1), 0.2, p, seed, w, window or None,
                                      brgemm=brgemm)
    ref, ref_grads = outputs_and_grads(
        lambda x, w=None: window_attention(*x.split(dim, dim=-1), 0.2, window or s, w, keep, p),
        [t.double() for t in inputs], grad.double())
    if tiny:
        kernels.set_cpu_caches(4096, 16384)
    try:
        got = outputs_and_grads(run, inputs, grad)
        monkeypatch.setattr(fused_attention, "bf16_dot_products", lambda: False)
        widened = outputs_and_grads(run, inputs, grad)
    finally:
        kernels.set_cpu_caches(0, 0)
    for name, x, w, want in zip(["out"] + ["dqkv", "dsinks"][:len(inputs)],
                                [got[0], *got[1]], [widened[0], *widened[1]], [ref, *ref_grads]):
        assert x.dtype == torch.bfloat16, name
        err, bound = rel_err(x.double(), want), 2 * rel_err(w.double(), want) + 2e-3
        # the sinks' gradient sums dout . out over every row, with cancellation: the widened
        # path's float32 sums are far closer there; the bound is 1e-2 alone
        assert err < 1e-2 and (name == "dsinks" or err <= bound), (name, err, bound)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("brgemm", [False, True], ids=["dot", "brgemm"])
def test_bfloat16_kernel_calls(kernels, causal, brgemm):
    """The extension's own calls: bfloat16 q, k, v over all keys or causal (ring attention's
    blocks) within bfloat16 rounding of the float32 kernel, lse in float32, with either way
    to the products; one dtype for all inputs; where the build or CPU lacks AVX512-BF16, or
    torch oneDNN's microkernels, a clear error."""
    torch.manual_seed(3)
    q, k, v, dout = (torch.randn(70, 2, 3, 32).bfloat16() for _ in range(4))
    if not kernels.attention_bf16_dot():
        with pytest.raises(RuntimeError, match="needs AVX512-BF16"):
            kernels.causal_attention_forward(q, k, v, 0.3, causal)
        return
    if brgemm and not kernels.attention_brgemm():
        with pytest.raises(RuntimeError, match="pass brgemm=False"):
            kernels.causal_attention_forward(q, k, v, 0.3, causal, brgemm=True)
        return
    out, lse = kernels.causal_attention_forward(q, k, v, 0.3, causal, brgemm=brgemm)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    wide = [t.float() for t in (q, k, v)]
    ref_out, ref_lse = kernels.causal_attention_forward(*wide, 0.3, causal)
    assert rel_err(out.float(), ref_out) < 1e-2 and rel_err(lse, ref_lse) < 1e-6
    with pytest.raises(RuntimeError, match="pass brgemm=False"):
        kernels.causal_attention_forward(*wide, 0.3, causal, brgemm=True)
    grads = kernels.causal_attention_backward(dout, q, k, v, out, lse, 0.3, causal,
                                              brgemm=brgemm)
    ref_grads = kernels.causal_attention_backward(dout.float(), *wide, ref_out, ref_lse, 0.3,
                                                  causal)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == torch.bfloat16 and rel_err(g.float(), r) < 1e-2
    with pytest.raises(RuntimeError, match="of one dtype"):
        kernels.causal_attention_forward(q, k.float(), v, 0.3, causal)


@needs_bf16_dot
def test_bfloat16_products_decision_is_measured_cached_and_taken(kernels, tmp_path, monkeypatch):
    """auto's "attention_products": both ways timed on the decision's shapes (each step runs
    the kernel forward and backward), the faster taken and cached, re-measured once the cache
    is deleted; the rule takes the microkernels exactly where they use AMX; the forward and
    backward then run the way taken."""
    from megatron.fused import choice
    if not kernels.attention_brgemm():
        pytest.skip("this torch's oneDNN has no bfloat16 microkernels")
    cache = tmp_path / "kernel-choice.json"
    monkeypatch.setenv(choice.MODE_ENV, "auto")
    monkeypatch.setenv(choice.CACHE_ENV, str(cache))
    timings, taken = {"ours": 1.0, "plain": 2.0}, []

    def fake_time_pair(ours, plain):
        ours(), plain()
        return timings["ours"], timings["plain"]
    real_forward = kernels.causal_attention_forward
    monkeypatch.setattr(choice, "time_pair", fake_time_pair)
    q = torch.randn(40, 1, 2, 32).bfloat16()
    try:
        choice.reset()
        assert fused_attention.brgemm_preferred(q)
        record, = json.loads(cache.read_text())["choices"].values()
        assert record["choice"] == "ours"
        timings.update(ours=3.0)
        choice.reset()
        assert fused_attention.brgemm_preferred(q), "the cached answer, not a new timing"
        cache.unlink()
        choice.reset()
        assert not fused_attention.brgemm_preferred(q)
        monkeypatch.setenv(choice.MODE_ENV, "rule")
        choice.reset()
        assert fused_attention.brgemm_preferred(q) == kernels.attention_brgemm_amx()
        monkeypatch.setenv(choice.MODE_ENV, "ours")
        monkeypatch.setattr(kernels, "causal_attention_forward",
                            lambda *a: taken.append(a[-1]) or real_forward(*a))
        qkv = torch.randn(40, 1, 2, 96).bfloat16().requires_grad_()
        fused.causal_attention(*qkv.split(32, dim=-1), 0.2).sum().backward()
        assert taken == [True] and qkv.grad is not None
    finally:
        choice.reset()
