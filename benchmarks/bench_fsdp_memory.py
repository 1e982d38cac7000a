"""Per-rank memory under --use-torch-fsdp2 at DP 1, 2 and 4, measured on gloo ranks of this
CPU, against DP 1 without FSDP (FSDP refuses a mesh of one rank) and against the planner.

    python benchmarks/bench_fsdp_memory.py [--layers 4] [--hidden 256] [--vocab 8192] \\
        [--steps 2] [--budget-mib 80]

The model (untied LLaMA-style: RMSNorm, SwiGLU, RoPE, fp32, Adam) has small activations
(sequence 32, micro batch 1, one micro batch per rank) and most of its bytes in parameters,
gradients and Adam's state. Each DP size runs in its own spawn of that many ranks (one
torch thread each); every rank takes `--steps` training steps of pretrain_gpt.py's step.
Printed per DP size, for rank 0 (the largest shards; ranks differ only by FSDP's padding):
- state: the bytes of parameters + gradients + optimizer state the rank holds after the
  steps (the storages of the DTensor parameters' local shards, their sharded gradients and
  Adam's moments; without FSDP the parameters, our reducer's buffer and Adam's state), and
  the planner's (megatron/training/memory.py) over it;
- peak: the most the rank held at once over the steps (what it held before them plus the
  most they allocated on top, torch.profiler's allocator events: gathered units, unsharded
  gradients, activations), and the planner's total over it;
- whether the peak fits `--budget-mib`.
Then the ratio of DP 4's state to DP 1's (target <= 0.35) and of the peaks.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.arguments import parse_args  # noqa: E402
from megatron.training.memory import Layout, estimate  # noqa: E402
from tests.distributed.fsdp_memory import measure  # noqa: E402
from tests.distributed.run_ranks import run_ranks  # noqa: E402

TARGET = 0.35
STATE = ("parameters", "gradients", "optimizer")
MiB = 2 ** 20


def config_for(args, dp: int):
    argv = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
            "--num-attention-heads", "4", "--ffn-hidden-size", str(3 * args.hidden),
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
            "--global-batch-size", str(dp), "--train-iters", "100", "--lr", "1e-4",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--normalization", "RMSNorm",
            "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", *(["--use-torch-fsdp2"] if dp > 1 else [])]
    config, _ = parse_args(argv, world_size=dp)
    config.model.padded_vocab_size = args.vocab
    return config


def _rank(rank, world_size, args):
    from megatron.mpu import initialize_model_parallel
    return measure(config_for(args, world_size), initialize_model_parallel(1, 1), args.vocab,
                   steps=args.steps, peak=True)


def run(args, dp: int) -> dict:
    start = time.perf_counter()
    measured = run_ranks(_rank, dp, args, timeout=600)[0]
    planned = estimate(config_for(args, dp), Layout(world_size=dp, device_type="cpu"))
    return {"state": sum(measured[key] for key in STATE), "peak": measured["peak"],
            "planned state": sum(planned[key] for key in STATE), "planned peak": planned["total"],
            "seconds": time.perf_counter() - start}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--budget-mib", type=float, default=80.0,
                   help="a per-rank budget the peaks are held against")
    args = p.parse_args(argv)
    results = {}
    print(f"{'DP':>3} {'state MiB':>10} {'planned/measured':>17} {'peak MiB':>9} "
          f"{'planned/measured':>17} {'fits':>5} {'s':>6}")
    for dp in (1, 2, 4):
        r = results[dp] = run(args, dp)
        fits = r["peak"] <= args.budget_mib * MiB
        print(f"{dp:>3} {r['state'] / MiB:>10.2f} {r['planned state'] / r['state']:>17.3f} "
              f"{r['peak'] / MiB:>9.2f} {r['planned peak'] / r['peak']:>17.3f} "
              f"{'yes' if fits else 'no':>5} {r['seconds']:>6.1f}", flush=True)
    ratio = results[4]["state"] / results[1]["state"]
    print(f"state DP4/DP1: {ratio:.3f} (target <= {TARGET}: {'met' if ratio <= TARGET else 'MISSED'})")
    print(f"peak DP4/DP1: {results[4]['peak'] / results[1]['peak']:.3f}")
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
