"""Files published whole, and their digests: the one way this project writes a file that
someone may read (checkpoints, dataset builds and index caches, kernel build stamps, tool
outputs).

A file is written under `<name>.tmp.<pid>`, flushed and fsynced, renamed over `<name>` and
its directory fsynced, so after a crash or power loss the name holds either the old or the
new complete file; an interrupted write removes its temporary file. Something made under
a temporary name by another program (a compiler's output, a staging directory) is
published by `publish`.
"""
import hashlib
import os
import re
from typing import Sequence, Tuple

_READ_CHUNK = 1 << 22
TEMP_FILE = re.compile(r"\.tmp\.(\d+)$")
"""The temporary name of a write in progress (or killed): `<name>.tmp.<pid>`."""


def temp_name(path: str) -> str:
    return f"{path}.tmp.{os.getpid()}"


class KeepsWriteError:
    """A file wrapper that keeps the first OSError a write met (torch.save replaces it with a
    generic RuntimeError, which no longer says ENOSPC)."""

    def __init__(self, file):
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self.file.flush()


class HashingWriter(KeepsWriteError):
    """A file wrapper that hashes what passes through and keeps the first OSError."""

    def __init__(self, file):
        super().__init__(file)
        self.sha256 = hashlib.sha256()

    def write(self, data) -> int:
        written = super().write(data)
        self.sha256.update(data)
        return written


def fsync_dir(directory: str) -> None:
    fd = os.open(directory or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def write_durably(path: str, write, invalidates: Sequence[str] = ()) -> str:
    """Run `write(file)` on the temporary name, fsync, rename to `path`, fsync the directory;
    returns the sha256 of the bytes written. `invalidates`: files that describe the old
    content (a checksum sidecar), removed just before the rename. On failure the temporary
    file is removed and the first OSError the file saw (a full disk, say) is raised, whatever
    `write` made of it."""
    tmp, digest = write_temp(path, write)
    for stale in invalidates:
        remove_quietly(stale)
    publish(tmp, path)
    return digest


def write_temp(path: str, write) -> Tuple[str, str]:
    """(temporary name, sha256): `write(file)` run on the temporary name of `path` and
    fsynced, not yet published (for several files published together); as write_durably on
    failure."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            writer = HashingWriter(f)
            try:
                write(writer)
                f.flush()
                os.fsync(f.fileno())
            except Exception as err:
                if writer.error is not None and writer.error is not err:
                    raise writer.error from None
                raise
    except BaseException:
        remove_quietly(tmp)
        raise
    return tmp, writer.sha256.hexdigest()


def write_text_durably(path: str, text: str) -> None:
    write_durably(path, lambda f: f.write(text.encode()))


def publish(tmp: str, final: str) -> None:
    """Rename the complete file or directory `tmp` over `final` and fsync their directory."""
    os.replace(tmp, final)
    fsync_dir(os.path.dirname(final))


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_READ_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()
