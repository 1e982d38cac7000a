"""The longest sequence that trains in a memory budget, at CP 1 and CP 2 (2 processes).

Model: LLaMA-style (RoPE, RMSNorm, SwiGLU, GQA with 2 groups), hidden 256, 8 heads,
2 layers, vocabulary 256, micro batch 1, float32, mock data. For each CP size the
planner (megatron/training/memory.py, as tools/estimate.py) gives the longest
sequence, in steps of 2048 tokens, whose per-rank total fits the budget; then one
training step at that length runs in CP processes and each reports its peak RSS
(VmHWM) and its RSS before training (imports and the torch runtime, which the
planner does not count). glibc's mmap threshold is fixed at 128 KiB for the runs
(MALLOC_MMAP_THRESHOLD_): its default, dynamic threshold keeps freed tensors in the heap,
and RSS then records the allocator's fragmentation rather than live memory (10-20% more
here, and more with CP's many short-lived blocks). Printed per CP size: the sequence, the planner's per-rank
total, the measured peak per rank, and planner / (peak - baseline).

    python benchmarks/bench_long_context.py [--budget-gib 20] [--step 2048]

The budget is per rank (a GPU's memory): CP 2 at 20 GiB needs 40 GiB of RAM. At 20 GiB the
2-layer model's step runs sequences near 4 * 10^5 tokens, whose attention takes hours on a few
shared cores; --num-layers 48 reaches a budget at ~10^4 tokens (8 GiB: a step of minutes), and
--budget-gib 0.5 measures the same ratios in seconds.
"""
import argparse
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_json  # noqa: E402
from megatron.arguments import build_parser, parse_args  # noqa: E402
from megatron.tokenizer import padded_vocab_size  # noqa: E402
from megatron.training.memory import GiB, Layout, estimate  # noqa: E402
from tests.distributed.run_ranks import run_ranks  # noqa: E402

VOCAB = 255  # NullTokenizer ids (+1 end of document)


LAYERS = 2  # --num-layers: deeper models reach a budget at shorter, faster sequences


def flags(seq: int, cp: int):
    return ["--num-layers", str(LAYERS), "--hidden-size", "256", "--num-attention-heads", "8",
            "--group-query-attention", "--num-query-groups", "2", "--swiglu",
            "--normalization", "RMSNorm", "--use-rotary-position-embeddings",
            "--disable-bias-linear", "--untie-embeddings-and-output-weights",
            "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
            "--lr", "1e-4", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
            "--make-vocab-size-divisible-by", "128", "--eval-interval", "1000",
            "--eval-iters", "0", "--log-interval", "1", "--num-workers", "0",
            "--context-parallel-size", str(cp)]


def set_layers(n: int) -> None:
    global LAYERS
    LAYERS = n
    os.environ["BENCH_LONG_CONTEXT_LAYERS"] = str(n)  # for spawned ranks


def planned_bytes(seq: int, cp: int) -> float:
    config, _ = parse_args(flags(seq, cp), parser=build_parser(), world_size=cp)
    config.model.padded_vocab_size = padded_vocab_size(VOCAB + 1, 128, 1)
    return estimate(config, Layout(world_size=cp, device_type="cpu"))["total"]


def longest(budget: float, cp: int, step: int) -> int:
    """The longest multiple of `step` whose planned per-rank total fits `budget`."""
    low, high = 0, step
    while planned_bytes(high, cp) <= budget:
        low, high = high, 2 * high
    while high - low > step:
        mid = (low + high) // 2 // step * step
        low, high = (mid, high) if planned_bytes(mid, cp) <= budget else (low, mid)
    return low


def _rss_bytes(field: str) -> int:
    """This process's VmRSS (resident now) or VmHWM (its peak) from /proc/self/status. Not
    ru_maxrss: a spawned rank's starts at its parent's resident size at the fork (Linux keeps
    the larger of the old and the new image's peak across exec), which read 0.379 GiB as the
    baseline of a rank whose own start-up was 0.269 GiB, and planner / measured 1.72 for 0.94."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # no /proc: Linux KiB


def _train(rank, world_size, seq):
    import pretrain_gpt
    set_layers(int(os.environ.get("BENCH_LONG_CONTEXT_LAYERS", LAYERS)))
    baseline = _rss_bytes("VmRSS")
    pretrain_gpt.main(flags(seq, world_size))
    return {"baseline": baseline, "peak": _rss_bytes("VmHWM")}


def measure(seq: int, cp: int):
    if cp == 1:  # in a process of its own too, so that earlier runs do not count
        return run_ranks(_train, 1, seq, timeout=3600)
    return run_ranks(_train, cp, seq, timeout=3600)


def main(argv=None):
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # inherited by the ranks
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-gib", type=float, default=20.0)
    p.add_argument("--step", type=int, default=2048, help="sequence granularity (tokens)")
    p.add_argument("--plan-only", action="store_true", help="skip the measured runs")
    p.add_argument("--cp-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--num-layers", type=int, default=LAYERS,
                   help="model depth (the measured ranks inherit it)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON (bench_json.py)")
    args = p.parse_args(argv)
    set_layers(args.num_layers)
    budget = args.budget_gib * GiB
    lengths, rows = {}, []
    for cp in args.cp_sizes:
        seq = lengths[cp] = longest(budget, cp, args.step)
        planned = planned_bytes(seq, cp)
        line = f"CP {cp}: longest sequence {seq} | planner per rank {planned / GiB:.3f} GiB"
        rows.append({"cp": cp, "seq": seq, "planned_gib": planned / GiB, "ranks": []})
        if not args.plan_only:
            for rank, r in enumerate(measure(seq, cp)):
                used = r["peak"] - r["baseline"]
                line += (f" | rank {rank}: peak RSS {r['peak'] / GiB:.3f} GiB (baseline "
                         f"{r['baseline'] / GiB:.3f}), planner / measured "
                         f"{planned / used:.3f}")
                rows[-1]["ranks"].append({"peak_gib": r["peak"] / GiB, "planner_over_measured":
                                          planned / used, "baseline_gib": r["baseline"] / GiB})
        print(line, flush=True)
    bench_json.write(args.json, "long_context", budget_gib=args.budget_gib, layers=LAYERS,
                     rows=rows)
    if 1 in lengths and 2 in lengths:
        print(f"CP 2 / CP 1 longest sequence: {lengths[2] / lengths[1]:.2f}x "
              f"(budget {args.budget_gib} GiB)")


if __name__ == "__main__":
    main()
