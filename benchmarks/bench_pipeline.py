"""Pipeline efficiency on CPU: 1F1B over 2 gloo ranks against the whole model on one rank.

Model: a stack of MLP blocks (x + W2 gelu(W1 x), hidden 512, ffn 2048, 256
tokens per micro-batch: compute-bound, the weights of a stage fit in cache),
split in two equal stages. Every process uses one thread and, where the machine
has a core per rank, is pinned to its own core (as each rank owns one GPU).

Measured bubble. With P stages of equal cost, perfect pipelining would take
T_single / P for the global batch, where T_single is the time one process takes
to run the whole model over the same M micro-batches. Everything above that is
bubble (idle stages) plus communication, so

    bubble = 1 - (T_single / P) / T_pipeline,

the idle fraction of the pipeline's time, which theory puts at (P-1)/(M+P-1)
for 1F1B. For fairness T_single is measured with both processes running the
whole model at the same time (both cores busy, as in the pipelined run), and
both runs are timed alike: from a common start until the slower process is
done. The single and pipelined runs alternate, and each time is the best of
several rounds.

Two more columns explain a gap between bubble and theory:

- idle: the fraction of the pipelined run each stage spends outside forward and
  backward compute (waits for its neighbour and p2p transfers), from the
  executor's timers.
- sync: what lockstep alone costs on this machine, with no pipeline code at
  all. Both processes run the same stage forward+backward M times and meet at a
  barrier after each; sync = sum over cycles of the slower rank's compute /
  the slower rank's total - 1. On a machine whose cores keep an equal speed it
  is 0; on a shared VM whose cores drift apart by a few percent, 1F1B (which
  meets its neighbour once per micro-batch) pays it on every micro-batch, so the
  best bubble this machine allows is 1 - M / ((M+P-1)(1+sync)), printed as
  "floor".

With ``--sleep-ms`` each block sleeps instead of computing: the same
measurement then checks the schedule, executor and p2p overheads alone, free of
the noise other processes cause on a shared machine.

Run from the repository root: python benchmarks/bench_pipeline.py [--quick] [--sleep-ms 10]
"""
import argparse
import gc
import itertools
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.pipeline import P2PCommunicator, forward_backward  # noqa: E402
from megatron.training.logging import Timers  # noqa: E402
from tests.distributed.run_ranks import run_ranks  # noqa: E402

PP = 2


class MLPBlock(nn.Module):
    """x + W2 gelu(W1 x)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class _Sleep(torch.autograd.Function):
    """Identity that sleeps: a stand-in for compute that other processes cannot slow down."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepBlock(nn.Module):
    """x * w, then sleep ``ms`` in forward and twice that in backward."""

    def __init__(self, ms: float):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))
        self.seconds = ms / 1000

    def forward(self, x):
        return _Sleep.apply(x * self.w, self.seconds, 2 * self.seconds)


class Stage(nn.Module):
    """A run of blocks; non-first stages read their input from set_input_tensor."""

    def __init__(self, cfg: dict, blocks: int, first: bool):
        super().__init__()
        if cfg["sleep_ms"] > 0:
            made = [SleepBlock(cfg["sleep_ms"]) for _ in range(blocks)]
        else:
            made = [MLPBlock(cfg["hidden"], cfg["ffn"]) for _ in range(blocks)]
        self.blocks = nn.Sequential(*made)
        self.first = first
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, x):
        return self.blocks(x)


def forward_step(batch_iter, model):
    batch = next(batch_iter)
    out = model(batch if model.first else model.input_tensor)
    return out, lambda o: ((o ** 2).mean(), {"lm loss": (o ** 2).mean().detach()})


def _time_once(fn) -> tuple[float, object]:
    """(wall time of fn() from a common start until every rank is done, what fn returned)."""
    dist.barrier()
    t0 = time.perf_counter()
    result = fn()
    dist.barrier()
    return time.perf_counter() - t0, result


def _pin_to_own_core(rank: int) -> bool:
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < PP:
        return False
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    return True


def _bench(rank, world_size, cfg):
    pinned = _pin_to_own_core(rank) if cfg["pin"] else False
    shape = (cfg["seq"], cfg["micro"], cfg["hidden"])
    torch.manual_seed(rank)
    # The input needs a gradient, as every later stage's does: then all stages do
    # the same work (the first would otherwise skip its first input gradient), and
    # the measured bubble is the schedule's, not a stage imbalance.
    batch = torch.randn(shape, requires_grad=True)
    whole = Stage(cfg, PP * cfg["blocks"], first=True)
    stage = Stage(cfg, cfg["blocks"], first=rank == 0)
    comm = P2PCommunicator(None, rank - 1 if rank else None, rank + 1 if rank < PP - 1 else None,
                           shape, torch.float32, "cpu")
    results = []
    gc.disable()  # no collector pauses inside the timed runs
    for m in cfg["microbatches"]:
        def single():
            forward_backward("none", forward_step=forward_step,
                             data_iterators=[itertools.repeat(batch)], model_chunks=[whole],
                             num_microbatches=m, comm=None, pp_rank=0, pp_size=1)

        def pipelined():
            timers = Timers(log_level=1)
            forward_backward("1f1b", forward_step=forward_step,
                             data_iterators=[itertools.repeat(batch)], model_chunks=[stage],
                             num_microbatches=m, comm=comm, pp_rank=rank, pp_size=PP,
                             timers=timers)
            return sum(timers.pop_all().values())  # forward + backward compute

        def lockstep():
            cycles = []
            for _ in range(m):
                t0 = time.perf_counter()
                stage(batch).backward(batch)
                cycles.append(time.perf_counter() - t0)
                dist.barrier()
            return cycles

        rounds = []
        for i in range(cfg["repeats"] + 1):  # the first round is a warm-up
            t_single, _ = _time_once(single)
            t_pipe, compute = _time_once(pipelined)
            _, cycles = _time_once(lockstep)
            if i:
                rounds.append(dict(single=t_single, pipe=t_pipe, compute=compute, cycles=cycles))
            gc.collect()
        results.append(rounds)
    return pinned, results


def _summary(m: int, rounds_per_rank: list[list[dict]]) -> dict:
    """Bubble, idle, sync and theory for one M from every rank's rounds."""
    by_round = list(zip(*rounds_per_rank))  # [round][rank]
    t_single = min(max(r["single"] for r in rnd) for rnd in by_round)
    best = min(by_round, key=lambda rnd: max(r["pipe"] for r in rnd))
    t_pipe = max(r["pipe"] for r in best)
    syncs = []
    for rnd in by_round:
        per_cycle = zip(*(r["cycles"] for r in rnd))
        syncs.append(sum(max(c) for c in per_cycle) / max(sum(r["cycles"]) for r in rnd) - 1)
    sync = statistics.median(syncs)
    theory = (PP - 1) / (m + PP - 1)
    return dict(m=m, t_single=t_single, t_pipe=t_pipe,
                bubble=1 - (t_single / PP) / t_pipe,
                idle=statistics.mean(1 - r["compute"] / r["pipe"] for r in best),
                sync=sync, floor=1 - m / ((m + PP - 1) * (1 + sync)), theory=theory)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--blocks-per-stage", type=int, default=6)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=12, help="timed rounds per M (best is kept)")
    parser.add_argument("--microbatches", default="1,2,4,8,16")
    parser.add_argument("--sleep-ms", type=float, default=0.0,
                        help="replace each block's compute by a sleep of this many ms forward "
                             "(twice that backward): checks the schedule apart from CPU load")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="let the OS place the ranks (default: each on its own core)")
    parser.add_argument("--quick", action="store_true", help="small model, 2 repeats")
    args = parser.parse_args()
    cfg = dict(hidden=args.hidden, ffn=args.ffn, blocks=args.blocks_per_stage, seq=args.seq,
               micro=args.micro_batch_size, repeats=args.repeats,
               microbatches=[int(m) for m in args.microbatches.split(",")],
               sleep_ms=args.sleep_ms, pin=args.pin)
    if args.quick:
        cfg.update(hidden=256, ffn=1024, repeats=2)
    compute = (f"sleep {cfg['sleep_ms']} ms fwd / {2 * cfg['sleep_ms']} ms bwd per block"
               if cfg["sleep_ms"] > 0 else f"MLP hidden {cfg['hidden']}, ffn {cfg['ffn']}")
    print(f"PP={PP} ranks x 1 thread vs 1 rank x 1 thread; {compute}, {cfg['blocks']} "
          f"blocks/stage, micro-batch {cfg['seq']}x{cfg['micro']}x{cfg['hidden']}, "
          f"best of {cfg['repeats']} rounds")
    per_rank = run_ranks(_bench, PP, cfg, timeout=3600)
    pinned = all(p for p, _ in per_rank)
    print(f"ranks {'pinned to one core each' if pinned else 'not pinned'}")
    print(f"{'M':>4} {'T_single (s)':>13} {'T_pipeline (s)':>15} {'bubble':>8} {'theory':>8} "
          f"{'idle':>8} {'sync':>8} {'floor':>8}")
    rows = [_summary(m, [results[i] for _, results in per_rank])
            for i, m in enumerate(cfg["microbatches"])]
    for r in rows:
        print(f"{r['m']:>4} {r['t_single']:>13.4f} {r['t_pipe']:>15.4f} {r['bubble']:>8.3f} "
              f"{r['theory']:>8.3f} {r['idle']:>8.3f} {r['sync']:>8.3f} {r['floor']:>8.3f}")
    print("bubble: 1 - (T_single / P) / T_pipeline; theory: (P-1)/(M+P-1); idle: time outside "
          "compute (executor timers); sync: this machine's cost of lockstep; floor: theory "
          "with that cost (see the module docstring)")
    worst = max((r["bubble"] - r["theory"] for r in rows if r["m"] >= 8), default=None)
    if worst is not None:
        print(f"M >= 8: largest bubble - theory = {worst:.3f} (target <= 0.05): "
              f"{'met' if worst <= 0.05 else 'NOT met'}")


if __name__ == "__main__":
    main()
