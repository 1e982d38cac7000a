"""--log-straggler (Megatron-LM's flag): every --log-interval, the slowest and fastest ranks'
step compute times, their ratio, and the slow ranks' hosts, printed by rank 0.

A rank's step compute time is its forward and backward compute per iteration (the
`forward-compute` and `backward-compute` timers, recorded for this even at
--timing-log-level 0) less the time it spent inside collectives there (the loss average over
DP, TP's reductions: mpu.mappings.COLLECTIVE_WAIT). Waiting for peers (those collectives,
pipeline exchanges, gradient reduction) is not in it: every rank of a synchronous step takes
the same wall time, but a slow rank computes for longer while the others wait for it. On
GPUs the collectives are asynchronous, so the compute timers' device synchronisation
includes waiting for them. --straggler-minmax-count names that many of each.
"""
import socket
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

COMPUTE_TIMERS = ("forward-compute", "backward-compute")


def _ranked(times_ms: Sequence[float], hosts: Sequence[str], ranks: Sequence[int]) -> str:
    return ", ".join(f"{times_ms[r]:.1f} (rank {r}, {hosts[r]})" for r in ranks)


def format_straggler_line(iteration: int, times_ms: Sequence[float], hosts: Sequence[str],
                          count: int = 1) -> str:
    """The report: `count` slowest and fastest ranks (slowest first, fastest first) and the
    ratio of the slowest time to the fastest."""
    order = sorted(range(len(times_ms)), key=lambda r: (-times_ms[r], r))
    count = min(count, len(order))
    slowest, fastest = order[:count], order[::-1][:count]
    ratio = times_ms[slowest[0]] / max(times_ms[fastest[0]], 1e-9)
    return (f" straggler report at iteration {iteration} | step compute time (ms) slowest: "
            f"{_ranked(times_ms, hosts, slowest)} | fastest: {_ranked(times_ms, hosts, fastest)}"
            f" | slowest/fastest: {ratio:.2f} |")


def describe_hosts(hosts: Sequence[str]) -> str:
    """' > ranks per host: node01: 0 1 | node02: 2 3' (hosts in the order of their first rank)."""
    by_host: Dict[str, List[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    return " > ranks per host: " + " | ".join(
        f"{host}: {' '.join(map(str, ranks))}" for host, ranks in by_host.items())


class StragglerDetector:
    """Gathers every rank's hostname once and its compute time per --log-interval."""

    def __init__(self, count: int):
        self.count = count
        self.hosts = [socket.gethostname()]
        if dist.is_initialized():
            self.hosts = [None] * dist.get_world_size()
            dist.all_gather_object(self.hosts, socket.gethostname())

    def report(self, iteration: int, timings: Dict[str, float], waits: Dict[str, float],
               iterations: int) -> Optional[str]:
        """Every rank calls this (a collective); rank 0 gets the line, the others None.
        `timings`, `waits`: the interval's Timers.pop_all() and pop_waits()."""
        busy = sum(timings.get(n, 0.0) - waits.get(n, 0.0) for n in COMPUTE_TIMERS)
        seconds = max(0.0, busy) / max(1, iterations)
        mine = torch.tensor([1000.0 * seconds], dtype=torch.float64)
        times = [mine]
        if dist.is_initialized():
            times = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(times, mine)
        if dist.is_initialized() and dist.get_rank() != 0:
            return None
        return format_straggler_line(iteration, [float(t) for t in times], self.hosts,
                                     self.count)
