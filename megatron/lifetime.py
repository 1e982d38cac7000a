"""Processes that end with their parent: a rank with its launcher (torchrun, the deepspeed
launcher, `torch.distributed.launch`), a DataLoader worker or an --async-save writer with its
training process. Killed with SIGKILL when the parent dies however it dies (itself killed
with SIGKILL, OOM): nothing keeps training, writing or holding --save once the job is gone.
The kernel drops the --save lock's flock with the process (checkpointing/lock.py), and the
next save clears what a killed save left (checkpointing/io.py, dist_io.py).
"""
import ctypes
import os
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1
WATCH_SECONDS = 0.2


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies: PR_SET_PDEATHSIG on Linux, else (or where
    prctl fails) a daemon thread that watches the parent's pid. A parent that died before
    the signal was set ends this process at once."""
    parent = os.getppid()
    if not _parent_death_signal():
        threading.Thread(target=_watch, args=(parent,), daemon=True,
                         name="parent watchdog").start()
    if os.getppid() != parent:
        os._exit(1)


def _parent_death_signal() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        threading.Event().wait(WATCH_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)


def launched() -> bool:
    """Whether this process is a rank started by a launcher (which sets LOCAL_RANK)."""
    return "LOCAL_RANK" in os.environ
