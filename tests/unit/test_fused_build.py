"""The fused-kernel library's build and loading: argument errors, the cached load, the build
lock, the compiler's reason in one warning, and the plain-path fallback when the build is
disabled or fails."""
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from megatron.fused import kernels as fused_kernels
from tests.fused_checks import kernels  # noqa: F401 (loads them; also a fixture below)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

def test_poison_mode_is_on(kernels):
    assert kernels.poison_outputs()


def test_bad_arguments_give_clear_errors(kernels):
    with pytest.raises(RuntimeError, match=r"\[batches, sq, sq\]"):
        kernels.scaled_upper_triang_masked_softmax_forward(torch.randn(2, 3, 4), 1.0)
    with pytest.raises(RuntimeError, match="mask shape"):
        kernels.scaled_masked_softmax_forward(
            torch.randn(2, 1, 3, 4), torch.zeros(2, 1, 3, 5, dtype=torch.bool), 1.0)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        kernels.layer_norm_forward(torch.randn(2, 3).double(), torch.ones(3).double(),
                                   torch.zeros(3).double(), 1e-5)
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.rms_norm_forward(torch.randn(2, 3), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.bias_gelu_forward(torch.randn(2, 3), torch.ones(4))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.causal_attention_forward(*(torch.randn(4, 1, 2, 8) for _ in range(3)), 1.0)
    with pytest.raises(RuntimeError, match="shapes differ"):
        kernels.causal_attention_forward(torch.randn(4, 1, 2, 16), torch.randn(5, 1, 2, 16),
                                         torch.randn(4, 1, 2, 16), 1.0)
    with pytest.raises(RuntimeError, match="row_max must be float32"):
        kernels.exp_sum_(torch.randn(2, 3), torch.ones(3))
    with pytest.raises(RuntimeError, match="rstd must be float32"):
        kernels.rms_norm_backward(torch.randn(2, 3), torch.randn(2, 3), torch.ones(3),
                                  torch.ones(3))


def test_cached_load_is_cheap():
    spec = fused_kernels._extension_specs()[fused_kernels.CPU_EXTENSION]
    start = time.perf_counter()
    module = fused_kernels._load_or_build(fused_kernels.CPU_EXTENSION, spec, verbose=False)
    assert time.perf_counter() - start < 2.0
    assert hasattr(module, "layer_norm_forward")


def test_extension_sources_for_setup_py():
    sources = fused_kernels.fused_extension_sources()
    assert sources and all(os.path.isfile(s) and s.endswith(".cpp") for s in sources)
    assert any(s.endswith("bindings_cpu.cpp") for s in sources)


def test_file_lock_excludes_other_holders(tmp_path):
    fcntl = pytest.importorskip("fcntl")
    lock = tmp_path / "build.lock"
    blocked = []

    def try_lock():
        with open(lock, "a+") as handle:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                blocked.append(False)
            except BlockingIOError:
                blocked.append(True)

    with fused_kernels._file_lock(lock):
        thread = threading.Thread(target=try_lock)
        thread.start()
        thread.join()
    try_lock()
    assert blocked == [True, False]


def test_short_reason_picks_compiler_error():
    exc = RuntimeError("Error building extension 'x': [1/2] c++ -c a.cpp\n"
                       "FAILED: a.o\na.cpp:3:1: error: expected ';'\nninja: build stopped")
    assert fused_kernels._short_reason(exc) == "a.cpp:3:1: error: expected ';'"


FALLBACK_SCRIPT = textwrap.dedent("""
    import os, sys, warnings
    warnings.simplefilter("default")
    import torch
    from megatron import fused
    from megatron.fused import kernels as fused_kernels
    build_dir = fused_kernels.build_root()
    assert not fused_kernels.fused_kernels_available(), "loaded at import"
    assert not build_dir.exists(), "built at import"
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    for _ in range(2):
        y = fused.attention_softmax(x, scale=0.5, causal=True)
        y.sum().backward()
        ln = fused.layer_norm(x, torch.ones(8), torch.zeros(8), 1e-5)
    ref = fused.attention_softmax(x, scale=0.5, causal=True, fusion=False)
    assert torch.equal(y, ref), "fallback differs from the plain path"
    assert not fused_kernels.load_fused_kernels()
    assert not fused_kernels.fused_kernels_available()
    print("FALLBACK-OK")
""")


def run_fallback_script(tmp_path, **env):
    full_env = dict(os.environ)
    full_env.pop(fused_kernels.DISABLE_ENV, None)
    full_env.update(MEGATRON_FUSED_BUILD_DIR=str(tmp_path / "build"), **env)
    full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "FALLBACK-OK" in proc.stdout, proc.stderr[-2000:]
    return [ln for ln in proc.stderr.splitlines() if "Warning" in ln]


def test_disabled_build_falls_back_with_one_warning(tmp_path):
    warnings_seen = run_fallback_script(tmp_path, MEGATRON_DISABLE_FUSED_BUILD="1")
    assert len(warnings_seen) == 1, warnings_seen
    assert "MEGATRON_DISABLE_FUSED_BUILD" in warnings_seen[0]


def test_compiler_failure_falls_back_with_its_reason(tmp_path):
    fake = tmp_path / "fake-c++"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = "-c" ] && '
                    '{ echo "x.cpp:1:1: error: simulated failure" >&2; exit 1; }; done\n'
                    'exec c++ "$@"\n')
    fake.chmod(0o755)
    warnings_seen = run_fallback_script(tmp_path, CXX=str(fake))
    assert len(warnings_seen) == 1, warnings_seen
    assert "error: simulated failure" in warnings_seen[0]
