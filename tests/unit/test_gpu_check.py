"""benchmarks/gpu_check.sh is valid bash and its Python parts run at a toy size on the CPU."""
import os
import subprocess

from tests.conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def test_gpu_check_parses_and_its_toy_run_reports_ratios_and_mfu():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=400,
                         env=dict(os.environ, GPU_CHECK_TOY="1", OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    for section in ("== tests/gpu", "== benchmarks/bench_fused.py", "== benchmarks/bench_train_step.py"):
        assert section in out.stdout
    assert "ours / transformers: " in out.stdout and "ours / minimal: " in out.stdout
    assert "MFU" in out.stdout
