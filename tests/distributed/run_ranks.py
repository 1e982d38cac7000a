"""Run a function on N CPU ranks over gloo: the harness of every multi-rank test."""
import os
import pickle
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue):
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # by value (plain pickle): a tensor shared by file descriptor is lost when the rank
        # exits before the parent reads it (FileNotFoundError under load)
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # report every failure, including assertion errors
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size, *args, timeout=300):
    """Call `fn(rank, world_size, *args)` in `world_size` spawned gloo processes.

    `fn` must be a module-level function. Returns the per-rank results (picklable)
    in rank order; raises AssertionError with the failing ranks' tracebacks.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, failures = {}, []
    for _ in range(world_size):
        rank, ok, payload = _get(queue, procs, timeout)
        if ok:
            results[rank] = pickle.loads(payload)
        else:
            failures.append(f"rank {rank}:\n{payload}")
            if len(failures) == 1:
                _stop_after_grace(procs)
            break
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if failures:
        raise AssertionError("\n".join(failures))
    return [results[r] for r in range(world_size)]


def _get(queue, procs, timeout):
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not queue.empty():
            return queue.get()
        if all(not p.is_alive() for p in procs) and queue.empty():
            codes = [p.exitcode for p in procs]
            return (-1, False, f"all ranks exited without reporting (exit codes {codes})")
        time.sleep(0.05)
    return (-1, False, f"timed out after {timeout} s")


def _stop_after_grace(procs, grace=5.0):
    """After one rank failed, the others may wait forever on a collective: stop them."""
    import time
    end = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
