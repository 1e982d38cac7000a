"""benchmarks/report.py: a --quick run writes the Markdown summary and valid PNG charts, each
labelled with the CPU, ISA, threads and commit; the charts cover every ISA they are given;
without matplotlib it says so in one line and exits 2."""
import json
import re
import struct
import subprocess
import sys
import zlib

from megatron.fused import kernels
from tests import oracles
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import report_charts  # noqa: E402

REPORT = ROOT / "benchmarks" / "report.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_chunks(data: bytes) -> list:
    """[(type, body)] of a PNG, every chunk's CRC checked."""
    assert data[:8] == PNG_SIGNATURE, "not a PNG"
    pos, chunks = 8, []
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in chunk {kind}"
        chunks.append((kind, body))
        pos += 12 + length
    return chunks


def check_png(path) -> str:
    """Check that `path` is a whole, decodable 8-bit RGBA PNG; return its Description text."""
    chunks = png_chunks(path.read_bytes())
    kinds = [kind for kind, _ in chunks]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    width, height, depth, color = struct.unpack(">IIBB", chunks[0][1][:10])
    assert width > 300 and height > 200 and (depth, color) == (8, 6)
    pixels = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    assert len(pixels) == height * (1 + 4 * width)  # a filter byte and RGBA per row
    text = dict(body.split(b"\0", 1) for kind, body in chunks if kind == b"tEXt")
    return text[b"Description"].decode("latin-1")


def commit() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=10", "HEAD"],
                          capture_output=True, text=True).stdout.strip() or "unknown"


@oracles.needs("transformers")
def test_quick_report_writes_labelled_summary_and_charts(tmp_path):
    out = tmp_path / "report"
    run = subprocess.run([sys.executable, str(REPORT), "--quick", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"report written to .* in \d+ s", run.stdout)
    summary = (out / "README.md").read_text()
    isa = kernels.supported_isas()[0]
    want = f"CPU {kernels.cpu_model()} | ISA {isa} | 2 threads | commit {commit()}"
    assert want in summary
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["attention_speedup.png", "long_context.png", "step_time.png"]
    for name in pngs:
        assert check_png(out / name).startswith(want), name
        assert f"]({name})" in summary
    for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", summary):
        assert (out / link).is_file(), link
    results = json.loads((out / "results.json").read_text())["results"]
    assert {r["run"] for r in results} == {"train_step fp32", "train_step bf16", "moe", "fused",
                                           "long_context"}
    assert all(r["rc"] == 0 and r["data"]["machine"]["isa"] == isa for r in results)
    assert "| GPT 1L h64 s64 b2 | bf16 | " in summary and "| MoE 8x top2 " in summary
    assert sum(1 for r in results if r["data"]["benchmark"] == "fused"
               for row in r["data"]["rows"]) == 2  # s256 and s512


def fake_results() -> list:
    """What the runs of two ISAs return, in the benchmarks' JSON shape (bench_json.py)."""
    def run(name, isa, **data):
        return {"run": name, "isa": isa, "command": f"python benchmarks/{name}", "rc": 0,
                "seconds": 1.0, "load_before": 0.5, "load_after": 0.7, "data": data}
    step = dict(benchmark="train_step", dtype="fp32", mfu=0.5,
                config={"layers": 4, "hidden": 256, "seq": 256, "batch": 8},
                ms_per_step={"ours": 400.0, "transformers": 560.0, "minimal": 480.0},
                ratios={"transformers": 1.4, "minimal": 1.2})
    rows = [{"name": f"CPU causal attention fwd+bwd s{s}", "ms": [2.0, 1.0], "speedup": 2.0,
             "auto": "fused", "verdict": "faster", "kernel": "attention", "seq": s, "batch": 1,
             "heads": 8, "head_dim": 64, "dropout": 0.0} for s in (1024, 256, 512)]
    rows.append({"name": "CPU attention window 128 fwd+bwd s1024", "ms": [3.0, 1.0],
                 "speedup": 3.0, "auto": "fused", "verdict": "faster", "kernel": "attention",
                 "seq": 1024, "batch": 1, "heads": 8, "head_dim": 64, "dropout": 0.0,
                 "window": 128, "sinks": False})
    rows.append({"name": "CPU layer norm fwd+bwd [2048,256] float32", "ms": [1.5, 1.0],
                 "speedup": 1.5, "auto": "plain", "verdict": "SLOWER"})
    long = dict(benchmark="long_context", budget_gib=0.25, layers=2, rows=[
        {"cp": 1, "seq": 4096, "planned_gib": 0.22,
         "ranks": [{"peak_gib": 0.5, "planner_over_measured": 0.94}]}])
    return [run("train_step fp32", isa, **step) for isa in ("avx512", "avx2")] + [
        run("fused", isa, benchmark="fused", rows=rows) for isa in ("avx512", "avx2")] + [
        run("long_context", "avx512", **long)]


def test_charts_cover_every_isa(tmp_path):
    meta = {"cpu": "Test CPU", "best_isa": "avx512", "isas": ["avx512", "avx2"], "threads": 2,
            "commit": "abc1234567", "quick": False, "seconds": 600.0, "cpu_count": 2,
            "date": "2026-12-02 12:00 UTC"}
    report_charts.write_report(tmp_path, meta, fake_results())
    summary = (tmp_path / "README.md").read_text()
    want = "CPU Test CPU | ISA avx512 + avx2 (forced) | 2 threads | commit abc1234567"
    assert want in summary and "Shared machine" not in summary
    for name in report_charts.FIGURES:
        label = check_png(tmp_path / name)
        assert label.startswith("CPU Test CPU | ISA avx512") and label.endswith("abc1234567")
    assert "+ avx2 (forced)" in check_png(tmp_path / "attention_speedup.png")
    assert summary.count("| 1024 | b1 h8 d64 | causal | float32 | 0.0 |") == 2  # one per ISA
    seqs = re.findall(r"^\| (\d+) \| b1 h8 d64 \| causal \| float32 \| 0.0 \| (\w+) \|",
                      summary, re.M)
    assert seqs == [(s, isa) for isa in ("avx512", "avx2") for s in ("256", "512", "1024")]
    # a variant is its own row (after the plain lines of its ISA) and its own line in the chart
    assert summary.count("| 1024 | b1 h8 d64 | window 128 | float32 | 0.0 |") == 2
    rows = [line for line in summary.splitlines() if "| b1 h8 d64 |" in line]
    assert "window 128" in rows[3] and "window 128" in rows[7]
    lines = {}
    for row in report_charts.fused_rows(fake_results(), True):
        lines.setdefault((row["isa"], report_charts.variant(row)), []).append(row["seq"])
    assert lines[("avx512", "window 128")] == [1024] and len(lines[("avx2", "causal")]) == 3
    assert "| layer norm [2048,256] float32 | avx2 | 1.50 | 1.00 | 1.50x | plain (SLOWER) |" in summary
    results = fake_results()
    results[0]["load_after"] = 9.0
    report_charts.write_report(tmp_path, meta, results)
    assert "**Shared machine:** the load average reached 9.0" in (tmp_path / "README.md").read_text()


def test_without_matplotlib_one_line_and_exit_2(tmp_path):
    (tmp_path / "matplotlib").mkdir()
    (tmp_path / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib')\n")
    run = subprocess.run([sys.executable, str(REPORT), "--quick", "--out", str(tmp_path / "r")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)})
    assert run.returncode == 2
    assert run.stdout == "" and len(run.stderr.strip().splitlines()) == 1
    assert "matplotlib is not installed" in run.stderr
    assert not (tmp_path / "r").exists()
