"""A run owns its --save: an advisory lock file, so two runs never write one directory.

``<save>/.megatron_save.lock`` holds the owner's pid, host and start time as JSON,
and the owner keeps an flock(2) on it for its whole life; the kernel drops the flock
when the process dies, however it dies. A second run finds the flock held and is
refused naming the owner. A lock file left by a dead process of this host (SIGKILL,
OOM, power loss) is taken over with a notice. A lock written by another host is
never taken over: this host cannot see that process; the message says to remove it.
"""
import fcntl
import json
import os
import socket
import time
from typing import Optional

from megatron.checkpointing.io import CheckpointError, pid_alive

LOCK_FILE = ".megatron_save.lock"


def _describe(holder: dict) -> str:
    started = holder.get("start_time")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    return f"pid {holder.get('pid')} on host {holder.get('host')} (started {when})"


def _read(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode("utf-8", "replace")
    try:
        holder = json.loads(text)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


class SaveLock:
    """The lock on one --save directory, held from `acquire` until `release` (or death)."""

    def __init__(self, directory: str):
        self.directory = directory
        self.path = os.path.join(directory, LOCK_FILE)
        self.fd: Optional[int] = None

    def acquire(self) -> Optional[str]:
        """Take the lock; returns a notice when a stale lock was taken over. A held lock
        raises CheckpointError naming its holder."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise CheckpointError(f"--save {self.directory} is in use by another run: "
                                  f"{_describe(holder)} holds {self.path}; wait for it to end "
                                  f"or give this run another --save") from None
        holder = _read(fd)
        try:
            notice = self._stale_notice(holder)
        except CheckpointError:
            os.close(fd)
            raise
        me = {"pid": os.getpid(), "host": socket.gethostname(), "start_time": time.time()}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(me).encode())
        os.fsync(fd)
        self.fd = fd
        return notice

    def _stale_notice(self, holder: dict) -> Optional[str]:
        """The flock was free: a notice when the file names a dead process of this host.
        A live holder (a filesystem whose flock does nothing) or another host's is refused."""
        pid = int(holder.get("pid") or 0)
        if not pid or (pid == os.getpid() and holder.get("host") == socket.gethostname()):
            return None
        if holder.get("host") != socket.gethostname() or pid_alive(pid):
            raise CheckpointError(f"--save {self.directory} is locked by {_describe(holder)}, "
                                  f"which may still be running; if that run has ended, remove "
                                  f"{self.path}")
        return (f" > --save {self.directory}: took over the stale lock of {_describe(holder)}, "
                f"which is no longer running")

    def release(self) -> None:
        """Remove the lock file and drop the flock (idempotent)."""
        if self.fd is None:
            return
        try:
            if _read(self.fd).get("pid") == os.getpid():
                os.remove(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None
