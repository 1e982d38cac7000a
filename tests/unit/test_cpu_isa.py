"""MEGATRON_CPU_ISA: each instruction set's build of the CPU kernels against the plain path.

Each case runs in a fresh process with MEGATRON_CPU_ISA set, so it loads (and on first
use builds, into the same cache as the other tests) the library for that instruction set
alone; an AVX-512 machine thus checks the AVX2 code too. Skipped where the CPU lacks it.
"""
import os
import subprocess
import sys
import textwrap

import pytest

from megatron.fused import kernels as fused_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Every CPU kernel, outputs and input gradients, against fusion=False / SDPA; poisoned
# outputs catch unwritten elements. Shapes include row tails shorter than one vector, and rows
# whose vectors leave 3 over the 4 partial sums of the reductions (120, 59 columns).
CHECK = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from megatron import fused
    from megatron.fused import kernels as K
    from megatron.mpu.cross_entropy import linear_cross_entropy
    from megatron.model import context_parallel as cp
    from tests.fused_checks import explicit_attention, outputs_and_grads, rel_err
    assert K.load_fused_kernels()
    K.set_poison_outputs(True)
    assert K.get_extension("cpu").isa == {isa!r}, K.get_extension("cpu").isa
    torch.manual_seed(0)

    def sdpa(q, k, v):
        s, b, h, d = q.shape
        out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                             is_causal=True)
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)

    def check(name, fused_fn, plain_fn, shapes, grad_shape, tol):
        tensors, grad = [torch.randn(s) for s in shapes], torch.randn(grad_shape)
        out, grads = outputs_and_grads(fused_fn, tensors, grad)
        ref, ref_grads = outputs_and_grads(plain_fn, tensors, grad)
        errs = [rel_err(out, ref)] + [rel_err(a, b) for a, b in zip(grads, ref_grads)]
        assert max(errs) < tol, (name, errs)

    for s, d in ((37, 16), (100, 48), (130, 64)):
        split = lambda x: x.split(d, dim=-1)
        check(f"attention s{{s}} d{{d}}", lambda x: fused.causal_attention(*split(x), d ** -0.5),
              lambda x: sdpa(*split(x)), [(s, 2, 3, 3 * d)], (s, 2, 3 * d), 5e-6)
    for s, d, p in ((37, 16, 0.3), (130, 64, 0.1)):  # attention dropout, the kernel's mask
        split = lambda x: x.split(d, dim=-1)
        keep = fused.attention_dropout_keep(6, s, p, 5)
        check(f"attention dropout s{{s}} d{{d}}",
              lambda x: fused.causal_attention(*split(x), d ** -0.5, p, 5),
              lambda x: explicit_attention(*split(x), d ** -0.5, True, keep, p),
              [(s, 2, 3, 3 * d)], (s, 2, 3 * d), 5e-6)
    for s, d in ((37, 16), (70, 32)):  # the full blocks of ring attention: out, lse, grads
        q, k, v, dout = (torch.randn(2, 3, s, d) for _ in range(4))
        fwd = [cp.block_forward(q, k, v, 0.2, False, f) for f in (True, False)]
        bwd = [cp.block_backward(q, k, v, *fwd[1], dout, 0.2, False, f) for f in (True, False)]
        errs = [rel_err(a, b) for a, b in zip(fwd[0] + tuple(bwd[0]), fwd[1] + tuple(bwd[1]))]
        assert max(errs) < 5e-6, ("full block", s, errs)
    # layer norm: the C++ autograd node; bf16 against float32 arithmetic on the same bf16
    # values; [700, 1024] float32 outputs come from the huge-page output cache (>= 2 MiB)
    for rows, cols, dtype, tol in ((70, 96, torch.float32, 1e-5), (70, 1000, torch.float32, 1e-5),
                                   (70, 13, torch.float32, 1e-5), (70, 120, torch.float32, 1e-5),
                                   (700, 1024, torch.float32, 1e-5), (70, 59, torch.bfloat16, 1e-2),
                                   (70, 1000, torch.bfloat16, 1e-2), (33, 13, torch.bfloat16, 1e-2)):
        x, w, b = torch.randn(rows, cols) * 2 + 0.5, torch.rand(cols) + 0.5, torch.randn(cols)
        g = torch.randn(rows, cols)
        x, w, b, g = (t.to(dtype) for t in (x, w, b, g))
        out, grads = outputs_and_grads(lambda *t: fused.fused_layer_norm(*t, 1e-5), [x, w, b], g)
        ref, ref_grads = outputs_and_grads(
            lambda *t: F.layer_norm(t[0], (cols,), t[1], t[2], 1e-5),
            [t.float() for t in (x, w, b)], g.float())
        errs = [rel_err(out, ref)] + [rel_err(a, r) for a, r in zip(grads, ref_grads)]
        assert out.dtype == dtype and max(errs) < tol, ("layer_norm", rows, cols, dtype, errs)
    # attention: (batch, head) tasks claimed dynamically by the threads; the results are
    # bit-identical whatever the thread count (each task writes only its own rows)
    qkv, grad = torch.randn(48, 5, 7, 96), torch.randn(48, 5, 7 * 32)
    split = lambda x: x.split(32, dim=-1)
    first = {{}}
    for threads in (1, 2, 3, 8):
        torch.set_num_threads(threads)
        for p in (0.0, 0.2):
            out, grads = outputs_and_grads(
                lambda x: fused.causal_attention(*split(x), 32 ** -0.5, p, 3), [qkv], grad)
            ref, ref_grads = first.setdefault(p, (out, grads))
            assert torch.equal(out, ref) and torch.equal(grads[0], ref_grads[0]), (threads, p)
    torch.set_num_threads(2)
    assert rel_err(first[0.0][0], sdpa(*split(qkv))) < 5e-6
    for cols in (96, 1000, 13, 120):
        check(f"rms_norm {{cols}}", lambda x, w: fused.rms_norm(x, w, 1e-5),
              lambda x, w: fused.rms_norm(x, w, 1e-5, fusion=False),
              [(70, cols), (cols,)], (70, cols), 1e-5)
        check(f"bias_gelu {{cols}}", lambda b, y: fused.bias_gelu(b, y),
              lambda b, y: fused.bias_gelu(b, y, fusion=False), [(cols,), (70, cols)],
              (70, cols), 1e-5)
        check(f"softmax {{cols}}",
              lambda x: fused.attention_softmax(x, scale=0.5, causal=True),
              lambda x: fused.attention_softmax(x, scale=0.5, causal=True, fusion=False),
              [(2, 2, cols, cols)] if cols < 200 else [(1, 1, 40, 40)],
              (2, 2, cols, cols) if cols < 200 else (1, 1, 40, 40), 1e-5)
        target = torch.randint(0, cols, (70,))
        check(f"head + cross entropy {{cols}}",
              lambda h, w: linear_cross_entropy(h, w, target).sum(),
              lambda h, w: F.cross_entropy(F.linear(h, w), target, reduction="sum"),
              [(70, 32), (cols, 32)], (), 1e-5)
    print("all kernels match")
""")


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_each_isa_matches_the_plain_path(isa):
    if os.environ.get(fused_kernels.DISABLE_ENV, "0") not in ("", "0"):
        pytest.skip(f"{fused_kernels.DISABLE_ENV} is set")
    if isa not in fused_kernels.supported_isas():
        pytest.skip(f"this CPU has no {isa}")
    env = dict(os.environ, MEGATRON_CPU_ISA=isa, PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-c", CHECK.format(isa=isa)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "all kernels match" in result.stdout


def test_isa_choice_and_errors(monkeypatch):
    monkeypatch.setattr(fused_kernels, "_cpu_info",
                        lambda: ("Test CPU", {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe",
                                              "abm"}))
    monkeypatch.delenv(fused_kernels.ISA_ENV, raising=False)
    assert fused_kernels.cpu_isa() == "avx2"  # the best this CPU has
    assert fused_kernels.supported_isas() == ["avx2", "baseline"]
    assert "Test CPU" in fused_kernels.cpu_description()
    assert "our kernels avx2" in fused_kernels.cpu_description()
    monkeypatch.setenv(fused_kernels.ISA_ENV, "baseline")
    assert fused_kernels.cpu_isa() == "baseline"
    assert fused_kernels._cpu_cflags() == fused_kernels.CPU_CFLAGS
    monkeypatch.setenv(fused_kernels.ISA_ENV, "avx512")
    with pytest.raises(ValueError, match="lacks.*avx512f.*MEGATRON_CPU_ISA=avx2"):
        fused_kernels.cpu_isa()
    monkeypatch.setenv(fused_kernels.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="'sse9' is not one of"):
        fused_kernels.requested_isa()


def test_each_isa_has_its_own_build(monkeypatch):
    monkeypatch.setattr(fused_kernels, "_cpu_info", lambda: ("Test CPU", set()))
    keys = set()
    for isa in ("avx2", "avx512", "baseline"):
        monkeypatch.setenv(fused_kernels.ISA_ENV, isa)
        spec = fused_kernels._extension_specs()[fused_kernels.CPU_EXTENSION]
        assert fused_kernels.ISA_CFLAGS[isa] == spec["cflags"][len(fused_kernels.CPU_CFLAGS):]
        keys.add(fused_kernels._build_key(fused_kernels.CPU_EXTENSION, spec))
    assert len(keys) == 3


def test_auto_attention_rule_per_isa(monkeypatch):
    """The attention rule (`--fused-kernels-choice rule`, and decisions not agreed across
    ranks) takes our kernel only where bench_fused measured it faster than the other path
    on that instruction set on the machine it was tuned on (fused.KERNEL_MAX_SEQ): SDPA
    without dropout, the explicit path with it; otherwise that path."""
    import torch
    from megatron import fused
    from megatron.fused import attention, choice
    monkeypatch.setenv(choice.MODE_ENV, "rule")
    short, long_ = torch.randn(4096, 1, 2, 16), torch.randn(4100, 1, 2, 16)
    monkeypatch.setattr(attention, "causal_attention_fusable", lambda q, k, v, p=0.0: True)
    expected = {"avx512": (True, True, True), "avx2": (True, True, True),
                "baseline": (False, False, False), "not built": (False, False, False)}
    for isa, (want_short, want_long, want_dropout) in expected.items():
        monkeypatch.setattr(attention, "cpu_kernels_isa", lambda isa=isa: isa)
        assert fused.causal_attention_preferred(short, short, short) is want_short, isa
        assert fused.causal_attention_preferred(long_, long_, long_) is want_long, isa
        assert fused.causal_attention_preferred(long_, long_, long_, 0.1) is want_dropout, isa
    monkeypatch.setattr(attention, "causal_attention_fusable", lambda q, k, v, p=0.0: False)
    assert not fused.causal_attention_preferred(short, short, short)
