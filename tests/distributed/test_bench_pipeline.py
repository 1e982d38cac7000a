"""The pipeline benchmark runs end to end and prints its table (values are not judged here)."""
import re
import subprocess
import sys

from tests.conftest import ROOT


def test_bench_pipeline_runs_and_prints_every_column():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_pipeline.py"),
         "--hidden", "64", "--ffn", "128", "--seq", "8", "--microbatches", "1,8", "--repeats", "1"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    rows = {int(line.split()[0]): [float(x) for x in line.split()[1:]]
            for line in out.stdout.splitlines() if re.match(r"\s+\d+\s+\d", line)}
    assert sorted(rows) == [1, 8]
    assert all(len(values) == 7 for values in rows.values())  # times, bubble, theory, idle, sync, floor
    assert rows[1][3] == 0.5 and abs(rows[8][3] - 1 / 9) < 1e-3  # theory column
    assert re.search(r"M >= 8: largest bubble - theory = -?\d\.\d{3} \(target <= 0\.05\): (met|NOT met)",
                     out.stdout)
