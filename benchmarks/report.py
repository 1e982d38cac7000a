"""Runs the training-step, MoE, kernel and long-context benchmarks; writes a Markdown summary.
A benchmark report people can look at: the summary has a table per benchmark and PNG charts.

    python benchmarks/report.py [--out benchmarks/report] [--quick] [--isa avx512 avx2]
                                [--threads 2] [--only train_step moe fused long_context]

Each benchmark runs as a subprocess with `--json` (benchmarks/bench_json.py), its usual text
output passing through:

- train_step: bench_train_step.py, ours against transformers' GPT-2 and the nanoGPT-style
  minimal GPT, in fp32 and in bf16;
- moe: bench_moe.py, ours against transformers' Mixtral and the minimal loop-over-experts MoE;
- fused: bench_fused.py, every CPU kernel against its plain path, attention from s256 to
  s2048 with and without dropout, then (`fused long`) s4096 to s16384 without;
- long_context: bench_long_context.py, the longest sequence that trains in 0.25 GiB per rank
  at CP 1 and CP 2, planned and measured.

The kernels and the fp32 steps run once per ISA (`--isa`; by default every one of avx512 and
avx2 this CPU has: on an AVX-512 machine the AVX2 run is forced with MEGATRON_CPU_ISA=avx2,
which holds torch's kernels to AVX2 too); the bf16 step and the long-context run use the
best ISA only. `--out` (default benchmarks/report/) receives README.md, results.json (every
number) and the charts: step_time.png (ms per step against the peers per configuration,
dtype and ISA), attention_speedup.png (our attention kernel's speed-up against sequence
length per ISA), kernels.png (the other kernels' speed-ups per ISA) and long_context.png.
Every chart and the summary name the CPU, the ISAs, the thread count and the git commit.
The whole run took 12.3 minutes on 2 shared cores (7.7 minutes of CPU time); it prints
its elapsed time.
`--quick` runs tiny sizes with one repetition, the best ISA only (unless `--isa` says
otherwise), in about a minute: a smoke test of the report, not a measurement.
Needs matplotlib (`pip install matplotlib`, part of the `test` extra): without it, one line
says so and the exit status is 2. A benchmark that fails is named in the summary and makes
the exit status 1.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "benchmarks"
ISA_ENV = "MEGATRON_CPU_ISA"
# What benchmarks/isa_env.py sets for a forced ISA: cleared, so that each run's ISA is its own.
TORCH_ISA_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
QUICK_STEP = ["--layers", "1", "--hidden", "64", "--heads", "2", "--seq", "64", "--batch", "2",
              "--vocab", "512"]
ONCE = ["--reps", "1", "--steps", "1", "--warmup", "1"]
FULL_REPS = ["--reps", "3", "--steps", "2", "--warmup", "1"]


@dataclass
class Run:
    """One benchmark command: its name, script and flags, and whether it runs once per ISA."""
    name: str
    script: str
    flags: list
    per_isa: bool


def runs(quick: bool, threads: int) -> list:
    """The benchmark commands of a full report, or of a --quick one."""
    t = ["--threads", str(threads)]
    step = QUICK_STEP + ONCE if quick else FULL_REPS
    # float32 attention only: bfloat16's, where SDPA on AVX2 is 4-12x slower, would take the
    # run past 15 minutes (bench_fused.py times both by default)
    fused = ["--repeat", "1", "--only", "attention", "--max-seq", "512"] if quick else [
        "--repeat", "3", "--max-seq", "2048"]
    fused += ["--attention-dtypes", "float32"]
    long = ["--only", "attention", "--long", "--min-seq", "4096", "--repeat", "3",
            "--attention-dtypes", "float32"]
    long_context = (["--budget-gib", "0.1", "--step", "1024", "--cp-sizes", "1"] if quick else
                    ["--budget-gib", "0.25"])
    return [Run("train_step fp32", "bench_train_step.py", step, True),
            Run("train_step bf16", "bench_train_step.py", step + ["--bf16"], False),
            Run("moe", "bench_moe.py", (ONCE if quick else FULL_REPS) + t, True),
            Run("fused", "bench_fused.py", fused + t, True),
            *([] if quick else [Run("fused long", "bench_fused.py", long + t, True)]),
            Run("long_context", "bench_long_context.py", long_context, False)]


def run_env(isa: str, best: str, threads: int) -> dict:
    """The environment of one benchmark run: `threads` threads, our kernels (and torch's) at
    `isa`, forced through MEGATRON_CPU_ISA unless it is the best this CPU has."""
    env = {k: v for k, v in os.environ.items() if k not in (ISA_ENV, *TORCH_ISA_VARS)}
    env["OMP_NUM_THREADS"] = str(threads)
    if isa != best:
        env[ISA_ENV] = isa
    return env


def run_one(run: Run, isa: str, best: str, threads: int, tmp: Path) -> dict:
    """Run one benchmark (its output passes through); what it wrote with --json, its command,
    status, seconds and the load average before and after."""
    out = tmp / f"{run.name.replace(' ', '_')}-{isa}.json"
    cmd = [sys.executable, str(HERE / run.script), *run.flags, "--json", str(out)]
    forced = f"{ISA_ENV}={isa} " if isa != best else ""
    shown = forced + "python benchmarks/" + " ".join([run.script, *run.flags])
    print(f"== {run.name} ({isa}): {shown}", flush=True)
    load, start = os.getloadavg()[0], time.perf_counter()
    rc = subprocess.run(cmd, cwd=ROOT, env=run_env(isa, best, threads)).returncode
    seconds = time.perf_counter() - start
    data = json.loads(out.read_text()) if rc == 0 and out.exists() else None
    print(f"== {run.name} ({isa}): {'exit ' + str(rc) if rc else 'done'} in {seconds:.0f} s",
          flush=True)
    return {"run": run.name, "isa": isa, "command": shown, "rc": rc, "seconds": seconds,
            "load_before": load, "load_after": os.getloadavg()[0], "data": data}


def git_commit() -> str:
    """HEAD's short hash, with "+changes" when tracked files outside benchmarks/report differ."""
    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True,
                              text=True).stdout.strip()
    head = git("rev-parse", "--short=10", "HEAD")
    if not head:
        return "unknown (not a git checkout)"
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                  ":(exclude)benchmarks/report")
    return head + ("+changes" if changed else "")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE / "report",
                   help="folder of the report (README.md, results.json, PNG charts)")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, one repetition, best ISA only: a smoke test (~1 minute)")
    p.add_argument("--isa", nargs="+", choices=("avx512", "avx2", "baseline"),
                   help="ISAs of the per-ISA runs (default: every one of avx512 and avx2 this "
                        "CPU has; with --quick the best only)")
    p.add_argument("--threads", type=int, default=2, help="threads of every benchmark")
    p.add_argument("--only", nargs="+", choices=("train_step", "moe", "fused", "long_context"),
                   help="run only these benchmarks")
    return p.parse_args(argv)


def require_matplotlib() -> None:
    """One line and exit 2 when matplotlib is missing; else select its Agg backend."""
    try:
        import matplotlib
    except ImportError:
        print("report.py: matplotlib is not installed; `pip install matplotlib` (or the "
              "`test` extra: pip install -e '.[test]')", file=sys.stderr)
        sys.exit(2)
    matplotlib.use("Agg")


def main(argv=None) -> int:
    args = parse(argv)
    require_matplotlib()
    sys.path.insert(0, str(ROOT))
    import report_charts
    from megatron.fused import kernels
    start, commit = time.perf_counter(), git_commit()  # the code that runs
    supported = kernels.supported_isas()
    best = supported[0]
    isas = args.isa or ([best] if args.quick else
                        [isa for isa in supported if isa != "baseline"] or [best])
    missing = [isa for isa in isas if isa not in supported]
    if missing:
        print(f"report.py: this CPU cannot run --isa {' '.join(missing)}; it runs "
              f"{', '.join(supported)}", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in runs(args.quick, args.threads):
            if args.only and run.name.split()[0] not in args.only:
                continue
            for isa in isas if run.per_isa else [best]:
                results.append(run_one(run, isa, best, args.threads, Path(tmp)))
    meta = {"cpu": kernels.cpu_model(), "best_isa": best, "isas": isas,
            "threads": args.threads, "commit": commit, "quick": args.quick,
            "seconds": time.perf_counter() - start, "cpu_count": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    report_charts.write_report(args.out, meta, results)
    print(f"report written to {args.out} in {meta['seconds']:.0f} s "
          f"({meta['seconds'] / 60:.1f} min)")
    return 1 if any(r["rc"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
