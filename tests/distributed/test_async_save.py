"""--async-save (issue 20): training goes on while the checkpoint is written; a SIGKILL during
the write leaves the previous checkpoint, from which the run resumes exactly.

- Ten runs (one process each, saving every iteration in the background) are killed with
  SIGKILL as soon as the k-th save's staging directory appears, i.e. while a background
  write is in flight; each resumes from the tracker's iteration and reproduces the losses of
  an uninterrupted run bit for bit.
- 2 gloo ranks at TP 2 with --async-save: the tracker names the last iteration, and a run
  resumed from iteration 3 gives the uninterrupted losses.
"""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from tests.distributed.run_ranks import run_ranks
from tests.gpt_setup import losses, one_thread, preprocess_wiki, tiny_gpt_argv


ITERS = 8
KILLS = 10
ASYNC = ["--ckpt-format", "torch_dist", "--async-save", "--save-interval", "1"]


def _argv(prefix, workdir, *extra):
    return tiny_gpt_argv(prefix, os.path.join(workdir, "cache"), "--eval-iters", "0", *extra,
                         layers=2, iters=ITERS)


def _staging(save):
    return [n for n in os.listdir(save) if n.endswith(".torch_dist.tmp")] \
        if os.path.isdir(save) else []


def _run_and_kill(argv, save, kth: int, timeout=120):
    """Start training; SIGKILL it while the write of its `kth` save is in flight."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, os.path.join(str(ROOT), "pretrain_gpt.py"), *argv],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen, deadline, during_write = set(), time.monotonic() + timeout, False
    while proc.poll() is None and time.monotonic() < deadline:
        seen.update(_staging(save))
        if len(seen) >= kth and _staging(save):
            proc.send_signal(signal.SIGKILL)
            during_write = True
            break
        time.sleep(0.002)
    proc.wait()
    return during_write


def _tracker(save) -> int:
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        return int(f.read())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("async")
    return preprocess_wiki(out, docs=10), str(out)


def test_sigkill_during_async_write_resumes_exactly(corpus):
    import pretrain_gpt
    prefix, workdir = corpus
    with one_thread():
        reference = losses(pretrain_gpt.main(_argv(prefix, workdir)))
    killed_in_write = 0
    for k in range(KILLS):
        save = os.path.join(workdir, f"kill-{k}")
        killed_in_write += _run_and_kill(_argv(prefix, workdir, *ASYNC, "--save", save),
                                         save, kth=1 + k % (ITERS - 2))
        start = _tracker(save) if os.path.isfile(
            os.path.join(save, "latest_checkpointed_iteration.txt")) else 0
        assert start < ITERS, f"kill {k} came too late: the run had finished"
        with one_thread():
            resumed = pretrain_gpt.main(_argv(prefix, workdir, "--ckpt-format", "torch_dist",
                                              *(["--load", save] if start else [])))
        assert losses(resumed) == reference[start:], f"kill {k}: resumed from {start}"
        shutil.rmtree(save)
    assert killed_in_write == KILLS


def _rank(rank, world_size, prefix, workdir):
    import pretrain_gpt
    tp2 = ["--tensor-model-parallel-size", "2"]
    save = os.path.join(workdir, "tp2")
    full = pretrain_gpt.main(_argv(prefix, workdir, *tp2, *ASYNC, "--save", save))
    tracked = _tracker(save)
    import torch.distributed as dist
    dist.barrier()
    if rank == 0:
        with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("3")
    dist.barrier()
    resumed = pretrain_gpt.main(_argv(prefix, workdir, *tp2, "--ckpt-format", "torch_dist",
                                      "--load", save))
    return tracked, losses(full), losses(resumed)


def test_async_save_at_tp2_resumes_exactly(corpus):
    prefix, workdir = corpus
    for tracked, full, resumed in run_ranks(_rank, 2, prefix, workdir, timeout=300):
        assert tracked == ITERS
        assert resumed == full[3:]


def test_exit_signal_handler_waits_for_the_pending_save(corpus):
    """SIGTERM while a background write is in flight: the run saves the current iteration,
    waits for the writes and exits 0 with the tracker on that iteration, complete."""
    prefix, workdir = corpus
    save = os.path.join(workdir, "sigterm")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    argv = _argv(prefix, workdir, *ASYNC, "--save", save, "--exit-signal-handler")
    proc = subprocess.Popen([sys.executable, os.path.join(str(ROOT), "pretrain_gpt.py"), *argv],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not _staging(save) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-2000:]
    assert "exiting program" in output
    stopped = _tracker(save)
    assert stopped < ITERS
    assert f"saving checkpoint at iteration {stopped:7d}" in output
    folder = os.path.join(save, f"iter_{stopped:07d}")
    assert {"common.pt", ".metadata", "metadata.json"} <= set(os.listdir(folder))
    assert not _staging(save)


def test_failed_background_write_exits_2_with_one_line(corpus):
    """A write that fails in the writer process (here: a file where iteration 2's staging
    directory goes) stops training at the next save with one line and exit status 2."""
    prefix, workdir = corpus
    save = os.path.join(workdir, "blocked")
    os.makedirs(save)
    with open(os.path.join(save, ".iter_0000002.torch_dist.tmp"), "w") as f:
        f.write("in the way")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(str(ROOT), "pretrain_gpt.py"),
                           *_argv(prefix, workdir, *ASYNC, "--save", save)],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert "writing checkpoint iteration 2 in the background (--async-save) failed" in errors[0]
    assert "FileExistsError" in errors[0]
    assert _tracker(save) == 1
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("megatron-async-save-")
                and n.split("-")[3] == str(proc.pid)] if os.path.isdir("/dev/shm") else True
