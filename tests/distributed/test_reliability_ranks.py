"""Preemption and hangs at DP 2 under torchrun (gloo on CPU)."""
import os
import re
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


def torchrun(argv, new_session=False):
    """`python -m torch.distributed.run --nproc_per_node 2 pretrain_gpt.py argv`, output piped."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(port), str(ROOT / "pretrain_gpt.py"), *map(str, argv)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env=one_thread_env(), start_new_session=new_session)


def exit_statuses(out: str) -> list:
    """Each rank's exit status in torchrun's failure summary."""
    return [line.split(":")[1].split()[0] for line in out.splitlines()
            if line.strip().startswith("exitcode")]


def one_error_line_and_exit_2_everywhere(proc, timeout=120) -> str:
    """The one error line of a failed torchrun run whose ranks all exited 2, none printing a
    traceback of its own."""
    out = proc.communicate(timeout=timeout)[0]
    errors = [line for line in out.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == 1 and sorted(exit_statuses(out)) == ["2", "2"], out[-3000:]
    assert not [line for line in out.splitlines() if line.startswith("[rank")], out[-3000:]
    return errors[0]


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


def test_shared_validation_error_is_one_line_and_exit_2(data, tmp_path):
    """A refusal every rank reaches before the process group starts: rank 0 alone prints it
    and exits 2, torchrun's root cause (torchrun then adds its own failure summary and exits
    1). Rank 1 exits 2 too, or, if it had not reached the check when rank 0 exited (it was
    still importing on a loaded machine), is stopped by torchrun's SIGTERM (-15)."""
    start = time.monotonic()
    proc = torchrun(tiny_argv(*data, "--num-workers", "2", "--kill-switch-path",
                              tmp_path / "missing" / "stop"))
    out = proc.communicate(timeout=120)[0]
    assert time.monotonic() - start < 60
    errors = [line for line in out.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == 1 and "--kill-switch-path" in errors[0], out[-3000:]
    root_cause = out.split("Root Cause")[-1]
    assert exit_statuses(root_cause) == ["2"] and re.search(r"rank\s*: 0 ", root_cause), out[-3000:]
    assert set(exit_statuses(out)) <= {"2", "-15"} and proc.returncode == 1, out[-3000:]


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
    assert "2" in exit_statuses(out), out[-3000:]
    time.sleep(1)
    assert not session_processes(proc.pid), session_processes(proc.pid)


def test_lock_refusal_ends_every_rank_with_exit_2(data, tmp_path):
    """--save held by another run: rank 0 prints the refusal naming the holder, and both ranks
    exit 2 (before, rank 1 ran on until torchrun SIGTERMed it)."""
    from megatron.checkpointing.lock import SaveLock
    save = tmp_path / "ckpt"
    save.mkdir()
    holder = SaveLock(str(save))
    holder.acquire()
    try:
        start = time.monotonic()
        line = one_error_line_and_exit_2_everywhere(torchrun(tiny_argv(*data, "--save", save,
                                                                        iters=1000)))
    finally:
        holder.release()
    assert f"--save {save} is in use by another run: pid {os.getpid()} on host" in line, line
    assert time.monotonic() - start < 60


def test_full_disk_during_a_save_ends_every_rank_with_exit_2(data, tmp_path):
    """A torch_dist save at DP 2 onto a full tmpfs: one line naming ENOSPC, exit 2 on both
    ranks (no gloo traceback from the peer), the staging directory removed, the previous
    checkpoint tracked."""
    from tests.reliability_setup import small_tmpfs, tree_bytes
    flags = ["--ckpt-format", "torch_dist", "--save-interval", "1", "--num-workers", "0"]
    with one_thread():
        pretrain_gpt.main(tiny_argv(*data, *flags, "--save", tmp_path / "sized", iters=1))
    room = 3 * tree_bytes(tmp_path / "sized") // 2
    with small_tmpfs(tmp_path / "small", room - room % 4096) as mount:
        save = os.path.join(mount, "ckpt")
        line = one_error_line_and_exit_2_everywhere(torchrun(tiny_argv(*data, *flags, "--save",
                                                                        save, iters=2)))
        assert f"no space left on device (ENOSPC) in {save}: .iter_0000002.torch_dist.tmp" in line
        assert sorted(os.listdir(save)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


def test_sigkilled_launcher_takes_its_ranks_along(data, tmp_path):
    """SIGKILL of the torchrun agent in the middle of training: both ranks are gone within a
    few seconds (parent-death signal) and --save's lock is free."""
    import fcntl
    from megatron.checkpointing.lock import LOCK_FILE
    from tests.reliability_setup import session_processes
    save = tmp_path / "ckpt"
    proc, lines = torchrun(tiny_argv(*data, "--save", save, "--save-interval", "50",
                                     iters=100000), new_session=True), []
    try:
        read_until(proc, " iteration        3/", lines)
        ranks = [rank_pid(proc.pid, r) for r in (0, 1)]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") and
                                                  "Z" not in _state(p) for p in ranks):
            time.sleep(0.1)
        left = [p for p in ranks if os.path.exists(f"/proc/{p}") and "Z" not in _state(p)]
    finally:
        for pid in session_processes(proc.pid):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their launcher"
    # A killed rank's leader is a zombie before its other threads have exited and closed its
    # files: the lock is free once the last of them is gone, within the same few seconds.
    fd = os.open(save / LOCK_FILE, os.O_RDWR)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline + 5, f"{save / LOCK_FILE} is still held"
                time.sleep(0.1)
    finally:
        os.close(fd)


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
