"""A tiny byte-level GPT run (no reference data needed), shared by the reliability tests."""
import contextlib
import os
import signal
import subprocess
import sys
import time

import numpy as np

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
from tests.conftest import ROOT


def byte_dataset(directory, docs=40, seed=0) -> str:
    """A random byte-level corpus (ids < 256, eod 256) as an MMIDIDX dataset; returns its prefix."""
    prefix = os.path.join(str(directory), "bytes_text_document")
    if not os.path.exists(prefix + ".idx"):
        rng = np.random.RandomState(seed)
        builder = MMapIndexedDatasetBuilder(prefix + ".bin", np.uint16)
        for _ in range(docs):
            builder.add_item(np.append(rng.randint(97, 123, size=rng.randint(20, 80)), 256))
            builder.end_document()
        builder.finalize(prefix + ".idx")
    return prefix


def tiny_argv(prefix, cache, *extra, iters=4, layers=2, hidden=32, heads=4, seq=16):
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads",
            str(heads), "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(iters),
            "--lr", "1e-3", "--data-path", str(prefix), "--split", "90,10,0",
            "--tokenizer-type", "ByteLevelTokenizer", "--make-vocab-size-divisible-by", "16",
            "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0",
            "--num-workers", "0", "--data-cache-path", str(cache), "--hidden-dropout", "0",
            "--attention-dropout", "0", "--use-cpu-initialization", "--seed", "1234", *map(str, extra)]


@contextlib.contextmanager
def small_tmpfs(directory, size: int):
    """A tmpfs of `size` bytes mounted on `directory` for the block (a real full disk: we run
    as root here); the test is skipped, with one line, where mounting is not allowed."""
    import pytest
    os.makedirs(directory, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                              str(directory)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({(mounted.stderr.strip() or 'mount failed')})")
    try:
        yield str(directory)
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def tree_bytes(directory) -> int:
    """The bytes of the files under `directory`."""
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(directory)
               for n in names)


def one_thread_env():
    """Environment of a subprocess run on one thread (much faster on busy cores)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def bad_token_dataset(directory, token=700) -> str:
    """A byte-level dataset holding one id beyond the 257-id vocabulary in every document."""
    prefix = os.path.join(str(directory), "badtok_text_document")
    if not os.path.exists(prefix + ".idx"):
        rng = np.random.RandomState(1)
        builder = MMapIndexedDatasetBuilder(prefix + ".bin", np.uint16)
        for _ in range(40):
            doc = rng.randint(97, 123, size=40)
            doc[5] = token
            builder.add_item(np.append(doc, 256))
            builder.end_document()
        builder.finalize(prefix + ".idx")
    return prefix


def run_entry(argv, timeout=60, script="pretrain_gpt.py", code=None):
    """Run an entry point (or `python -c code argv`) in its own session; returns
    (exit status, stderr lines, seconds). Asserts that no process of its session is left."""
    cmd = [sys.executable, "-c", code, *map(str, argv)] if code else \
        [sys.executable, str(ROOT / script), *map(str, argv)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=one_thread_env(), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    seconds = time.monotonic() - start
    assert not session_processes(proc.pid), f"processes left behind: {session_processes(proc.pid)}"
    return proc.returncode, err.strip().splitlines(), seconds


def session_processes(sid: int) -> list:
    """Live (not zombie) processes of session `sid`, from /proc."""
    left = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: session id
            left.append(int(entry))
    return left


# Run pretrain_gpt.py with a disk that fills up after 100 kB of checkpoint data
# (the real ENOSPC code path of megatron.files, where checkpoint files are opened for
# writing, and of megatron.checkpointing.io; argv from the command line).
FULL_DISK_RUN = """
import errno, sys
sys.argv[0] = "pretrain_gpt.py"
import pretrain_gpt
from megatron import files

class Full:
    def __init__(self, f): self.f, self.room = f, 100_000
    def write(self, data):
        self.room -= len(data)
        if self.room < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(data)
    def __getattr__(self, name): return getattr(self.f, name)
    def __enter__(self): return self
    def __exit__(self, *exc): self.f.close()

real_open = open
files.open = lambda path, mode="r": Full(real_open(path, mode))
pretrain_gpt.main(sys.argv[1:])
"""
