"""Checkpoint files that are what they claim: durable, checksummed, never half-written.

Every file is written under ``<name>.tmp.<pid>``, fsynced, renamed, and its
directory fsynced, so after a crash or power loss a name holds either the old
or the new complete file. Each file gets a ``<name>.sha256`` sidecar in
``sha256sum`` format (``sha256sum -c`` checks it; Megatron-LM ignores it), which
is verified at load when present. Each file also carries ``content_sha256``, a digest
of everything it holds (tensor bytes, shapes, dtypes and plain values, walked in key
order), so a file whose sidecar is lost is still verified; a file with neither is
refused unless --no-verify-checkpoint (files written by Megatron-LM, and Megatron-Core's
torch_dist common.pt, carry neither and are read unverified, as there is nothing to check
them against). A full disk (ENOSPC)
becomes one CheckpointError naming the directory and the bytes needed; the partial
file is removed. Temporary files left by killed saves (of processes that no longer
exist) are removed at the next save.
"""
import contextlib
import errno
import hashlib
import os
import shutil
from typing import Callable, Optional

import numpy as np
import torch

from megatron.files import TEMP_FILE, file_sha256, remove_quietly, write_durably

CHECKSUM_SUFFIX = ".sha256"
CONTENT_DIGEST = "content_sha256"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used or written; the message says why and what to do.

    `agreed`: every rank of the run raises it together (collectives.agreed), so the entry
    point lets rank 0 alone print it, and every rank exits 2."""

    def __init__(self, message: str = "", agreed: bool = False):
        super().__init__(message)
        self.agreed = agreed


class _CountingSink:
    """Counts the bytes torch.save would write."""

    def __init__(self):
        self.bytes = 0

    def write(self, data) -> int:
        self.bytes += len(data)
        return len(data)

    def flush(self) -> None:
        pass


def no_space(directory: str, needed: int, what: str = "the checkpoint file",
             removed: str = "the partial file was removed", freed: int = 0) -> CheckpointError:
    """The one line of a full disk (ENOSPC): what needed how many bytes, how many are free
    (plus `freed`, what the clean-up gives back), what was removed."""
    free = shutil.disk_usage(directory).free + freed
    return CheckpointError(f"no space left on device (ENOSPC) in {directory}: {what} needs "
                           f"{needed} bytes and {free} are free; {removed} and the previous "
                           f"checkpoint stays the one to resume from")


def _write_durably(path: str, write) -> str:
    """files.write_durably, a full disk (ENOSPC) made one CheckpointError naming what was
    needed; returns the sha256 of the bytes written."""
    try:
        # a stale sidecar must never describe the new file
        return write_durably(path, write, invalidates=[path + CHECKSUM_SUFFIX])
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise no_space(os.path.dirname(path) or ".", _bytes_needed(write)) from None
        raise


def _bytes_needed(write) -> int:
    sink = _CountingSink()
    write(sink)
    return sink.bytes


def _feed(digest, value) -> None:
    """Hash `value` canonically: what it holds, not how pickle laid it out."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"T{tensor.dtype}{tuple(value.shape)}".encode())
        digest.update(memoryview(tensor.view(torch.uint8).numpy()))
    elif isinstance(value, np.ndarray):
        digest.update(f"A{value.dtype}{value.shape}".encode())
        digest.update(memoryview(np.ascontiguousarray(value)).cast("B"))
    elif isinstance(value, dict):
        digest.update(f"D{len(value)}".encode())
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode())
            _feed(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"L{len(value)}".encode())
        for item in value:
            _feed(digest, item)
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        _feed(digest, vars(value))  # argparse.Namespace
    else:
        digest.update(repr(value).encode())


def content_digest(state: dict) -> str:
    """sha256 of a checkpoint dict's content, without its own digest entry."""
    digest = hashlib.sha256()
    _feed(digest, {k: v for k, v in state.items() if k != CONTENT_DIGEST})
    return digest.hexdigest()


def save_file(obj, path: str) -> None:
    """torch.save `obj` to `path` durably, with its checksum sidecar (and, for a dict, an
    in-file digest of its content)."""
    if isinstance(obj, dict):
        obj = {**obj, CONTENT_DIGEST: content_digest(obj)}
    digest = _write_durably(path, lambda f: torch.save(obj, f))
    line = f"{digest}  {os.path.basename(path)}\n".encode()
    _write_durably(path + CHECKSUM_SUFFIX, lambda f: f.write(line))


def write_text(path: str, text: str) -> None:
    """Replace the small text file `path` (the tracker) durably."""
    _write_durably(path, lambda f: f.write(text.encode()))


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        return True
    return True


def remove_stale_temp_files(root: str) -> int:
    """Delete ``*.tmp.<pid>`` files under `root` left by killed saves; returns how many.
    Only files of processes that no longer exist are touched: a live writer's file
    (another run, or a rank of this one) is left alone."""
    removed = 0
    for directory, _, names in os.walk(root):
        for name in names:
            match = TEMP_FILE.search(name)
            if match and not pid_alive(int(match.group(1))):
                remove_quietly(os.path.join(directory, name))
                removed += 1
    return removed


def check_writable(directory: str, flag: str = "--save") -> None:
    """Fail early (not at the first save) when `directory` cannot be written."""
    probe = os.path.join(directory, f".write_probe.tmp.{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"probe")
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.remove(probe)
        raise CheckpointError(f"{flag} {directory} is not writable: {err.strerror or err}") from None


def verify_checksum(path: str) -> None:
    """Compare `path` with its sidecar (a file without one, e.g. from Megatron-LM, passes)."""
    sidecar = path + CHECKSUM_SUFFIX
    if not os.path.isfile(sidecar):
        return
    with open(sidecar, "rb") as f:
        expected = f.read().split(b" ", 1)[0].decode("ascii", "replace").strip()
    if file_sha256(path) != expected:
        raise CheckpointError(f"{path} does not match its checksum in {sidecar}: the file is "
                              f"corrupt; restore it or load an earlier iteration "
                              f"(--no-verify-checkpoint loads it anyway)")


def load_file(path: str, verify: bool = True, mmap: bool = False,
              foreign: Optional[Callable[[dict], bool]] = None):
    """torch.load(weights_only=True) of a checkpoint file, with megatron_legacy's allowlist
    (argparse.Namespace, numpy RNG states); any problem is a one-line CheckpointError.
    `foreign(state)`: whether a file without sidecar or digest was written by another
    framework, and so is read unverified (default: by Megatron-LM, is_megatron_file)."""
    from megatron.checkpointing.megatron_legacy import UnusableCheckpoint, safe_load
    if os.path.isdir(path) or not os.path.exists(path):
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete")
    if verify:
        verify_checksum(path)
    try:
        state = safe_load(path, mmap=mmap)
    except UnusableCheckpoint as err:  # objects beyond plain data: named, never run
        raise CheckpointError(str(err)) from None
    except Exception as err:  # truncated zip, hostile pickle, garbage: all unusable
        if not verify:
            verify_checksum(path)  # a corrupted file says so, rather than how torch failed
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise CheckpointError(f"{path} cannot be loaded as a checkpoint ({first}); it is "
                              f"truncated, corrupt or not a torch checkpoint") from None
    if verify and not os.path.isfile(path + CHECKSUM_SUFFIX):
        verify_content(path, state, foreign)
    return state


def verify_content(path: str, state, foreign: Optional[Callable[[dict], bool]] = None) -> None:
    """A file without a sidecar: check its in-file digest; refuse one that has none, unless
    another framework wrote it (`foreign`, default Megatron-LM's files): theirs never carry
    one, and there is nothing to check them against."""
    from megatron.checkpointing.megatron_legacy import is_megatron_file
    foreign = foreign or is_megatron_file
    if isinstance(state, dict) and CONTENT_DIGEST in state:
        if content_digest(state) != state[CONTENT_DIGEST]:
            raise CheckpointError(f"{path} does not match the digest it carries (and its "
                                  f"{CHECKSUM_SUFFIX} sidecar is missing): the file is corrupt; "
                                  f"restore it or load an earlier iteration")
    elif not (isinstance(state, dict) and foreign(state)):
        raise CheckpointError(f"{path} has no checksum sidecar ({os.path.basename(path)}"
                              f"{CHECKSUM_SUFFIX}) and no in-file digest, so it cannot be "
                              f"verified; restore the sidecar, or pass --no-verify-checkpoint "
                              f"to load it unverified")
