"""Preemption and hangs at DP 2 under torchrun (gloo on CPU)."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

import pretrain_gpt
from tests.conftest import ROOT
from tests.gpt_setup import one_thread
from tests.reliability_setup import byte_dataset, one_thread_env, tiny_argv


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    return byte_dataset(out), out / "cache"


def torchrun(argv):
    """`python -m torch.distributed.run --nproc_per_node 2 pretrain_gpt.py argv`, output piped."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(port), str(ROOT / "pretrain_gpt.py"), *map(str, argv)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env=one_thread_env())


def read_until(proc, words, lines):
    for line in proc.stdout:
        lines.append(line)
        if words in line:
            return line
    raise AssertionError("".join(lines[-30:]))


def logged_losses(lines):
    return {int(line.split("/")[0].split()[-1]): float(line.split("lm loss:")[1].split("|")[0])
            for line in lines if line.startswith(" iteration") and "lm loss:" in line}


def rank_pid(launcher: int, rank: int) -> int:
    for child in open(f"/proc/{launcher}/task/{launcher}/children").read().split():
        if f"RANK={rank}".encode() in open(f"/proc/{child}/environ", "rb").read().split(b"\0"):
            return int(child)
    raise AssertionError(f"no worker with RANK={rank}")


def test_sigterm_to_torchrun_saves_the_current_iteration_and_resumes(data, tmp_path):
    save = tmp_path / "ckpt"
    proc, lines = torchrun(tiny_argv(*data, "--exit-signal-handler", "--save", save, iters=60)), []
    read_until(proc, " iteration        2/", lines)
    proc.send_signal(signal.SIGTERM)  # torchrun forwards it to both workers
    lines += proc.stdout.readlines()
    proc.wait(timeout=120)  # the launcher itself reports the signal (torchrun's own status)
    exits = [line for line in lines if "exiting program at iteration" in line]
    assert len(exits) == 1 and ("SIGTERM received" in exits[0]  # rank 0 may get it second
                                or "another rank was asked to stop" in exits[0]), "".join(lines[-30:])
    stopped = int(exits[0].split("exiting program at iteration")[1].split(":")[0])
    assert (save / "latest_checkpointed_iteration.txt").read_text() == str(stopped)
    end = ["--exit-interval", stopped + 2]
    resumed, lines = torchrun(tiny_argv(*data, *end, "--load", save, iters=60)), []
    lines += resumed.stdout.readlines()
    assert resumed.wait(timeout=120) == 0, "".join(lines[-30:])
    with one_thread():
        full = pretrain_gpt.main(tiny_argv(*data, *end, iters=60)).history
    got = logged_losses(lines)
    assert sorted(got) == [stopped + 1, stopped + 2], "".join(lines[-30:])
    for h in full[stopped:]:
        assert got[h["iteration"]] == pytest.approx(h["lm loss"], rel=1e-5)


def test_stopped_rank_makes_its_peer_exit_within_the_timeout(data):
    """SIGSTOP rank 1 at DP 2 with --distributed-timeout-minutes 0.25: rank 0 exits
    non-zero within the timeout (plus slack), naming what it waited in."""
    proc = torchrun(tiny_argv(*data, "--distributed-timeout-minutes", "0.25", iters=100000))
    lines, stopped_pid = [], None
    try:
        read_until(proc, " iteration        3/", lines)
        stopped_pid = rank_pid(proc.pid, 1)
        os.kill(stopped_pid, signal.SIGSTOP)
        start = time.monotonic()
        line = read_until(proc, "error:", lines)
        waited = time.monotonic() - start
    finally:
        if stopped_pid is not None:
            os.kill(stopped_pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
    assert 14 < waited < 60, waited
    assert line.startswith("pretrain_gpt.py: error: rank 0 (pipeline stage 0, data-parallel rank 0) "
                           "waited --distributed-timeout-minutes 0.25 in "), line
    assert "micro batch" in line and "a peer rank stopped responding" in line, line
    assert " in a collective " not in line, line  # the phase it waited in is named


def test_shared_validation_error_is_one_line_and_exit_2_on_every_rank(data, tmp_path):
    """A refusal every rank reaches before the process group starts: rank 0 alone prints it,
    and both ranks exit 2 (torchrun then adds its own failure summary and exits 1)."""
    start = time.monotonic()
    proc = torchrun(tiny_argv(*data, "--num-workers", "2", "--kill-switch-path",
                              tmp_path / "missing" / "stop"))
    out = proc.communicate(timeout=120)[0]
    assert time.monotonic() - start < 60
    errors = [line for line in out.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == 1 and "--kill-switch-path" in errors[0], out[-3000:]
    statuses = [line.split(":")[1].split()[0] for line in out.splitlines()
                if line.strip().startswith("exitcode")]
    assert statuses == ["2", "2"] and proc.returncode == 1, out[-3000:]


def test_error_found_by_one_rank_ends_every_rank(tmp_path, data):
    """A token beyond the vocabulary, met in a loader worker at DP 2 (--num-workers 2): a rank
    that meets it prints it and exits 2; a peer left waiting says it lost that rank (not a
    timeout) or is stopped by torchrun; all within 60 s, no process left behind."""
    from tests.reliability_setup import bad_token_dataset, session_processes
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(port), str(ROOT / "pretrain_gpt.py"),
           *map(str, tiny_argv(bad_token_dataset(tmp_path), data[1], "--num-workers", "2"))]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env=one_thread_env(), start_new_session=True)
    out = proc.communicate(timeout=120)[0]
    assert time.monotonic() - start < 60 and proc.returncode == 1, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    token = [e for e in errors if "holds token id 700, outside the vocabulary of size 257" in e]
    lost = [e for e in errors if "lost its connection to a peer rank" in e]
    assert token and len(token) + len(lost) == len(errors) <= 2, out[-3000:]
    statuses = [line.split(":")[1].split()[0] for line in out.splitlines()
                if line.strip().startswith("exitcode")]
    assert "2" in statuses, out[-3000:]
    time.sleep(1)
    assert not session_processes(proc.pid), session_processes(proc.pid)
