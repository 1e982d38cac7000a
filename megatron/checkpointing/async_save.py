"""--async-save: checkpoints of any format written by a writer process while training goes on.

Every training rank starts one writer process at its first save (a fresh interpreter, at
the lowest scheduling priority) and keeps it for the run. At a save the rank takes its
format's snapshot (formats.CheckpointFormat.snapshot), copies every tensor in it into CPU
buffers that it shares with its writer (files under /dev/shm, mapped by both, allocated at
the first save and reused: a save allocates nothing), and hands the rest of the snapshot,
pickled, to the writer: that copy is all that blocks training. The writer puts tensors
(and DCP's ShardedTensors) over the shared buffers back into the snapshot and runs the
format's synchronous `write` (torch_dist: staging directory, DCP files, fsync, checksums,
rename, tracker; torch: each durable file, then the tracker), so the tracker moves only
once the new iteration is complete and durable. The
writers of all ranks form a gloo group of their own (rendezvous through the training's
MASTER_ADDR / MASTER_PORT store), so their collectives never interleave with training's,
and the serialisation, hashing and fsync run outside the training process and its GIL.

A writer dies with its training process (PR_SET_PDEATHSIG), so a SIGKILL during a write
leaves the previous checkpoint as the one to resume; it ignores SIGINT / SIGTERM, which
are the training process's to handle (--exit-signal-handler saves, then waits here).
One save is in flight at a time: the next save, the end of training and a stop on a
signal wait for it (`wait`). A failed write is raised there as one CheckpointError line
(the failing writer exits, so the other writers' collectives fail instead of hanging).

    python -m megatron.checkpointing.async_save READ_FD WRITE_FD    (the writer; internal)
"""
import os
import pickle
import select
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

from megatron.checkpointing import collectives
from megatron.checkpointing.api import format_named
from megatron.checkpointing.dist_regions import sharded_tensors
from megatron.checkpointing.formats import RunState
from megatron.checkpointing.io import CheckpointError
from megatron.lifetime import die_with_parent

_SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None


@dataclass(frozen=True)
class _Slot:
    """Where a tensor of the snapshot sits in the shared buffer of its dtype."""

    dtype: str
    offset: int
    shape: Tuple[int, ...]


@dataclass(frozen=True)
class _ShardedSlot:
    """A ShardedTensor of the snapshot: its global size and this rank's shards."""

    size: Tuple[int, ...]
    shards: Tuple[Tuple[_Slot, Tuple[int, ...]], ...]
    """(slot, global offsets) of each local shard."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _strip(obj, found: List[Tuple[_Slot, torch.Tensor]], used: Dict[str, int]):
    """`obj` with every tensor replaced by its slot (appended to `found`; `used` counts the
    elements given out per dtype)."""
    if isinstance(obj, ShardedTensor):
        return _ShardedSlot(tuple(obj.metadata().size), tuple(
            (_strip(s.tensor, found, used), tuple(s.metadata.shard_offsets))
            for s in obj.local_shards()))
    if isinstance(obj, torch.Tensor):
        slot = _Slot(_dtype_name(obj.dtype), used.get(_dtype_name(obj.dtype), 0), tuple(obj.shape))
        used[slot.dtype] = slot.offset + obj.numel()
        found.append((slot, obj))
        return slot
    if isinstance(obj, dict):
        return type(obj)((k, _strip(v, found, used)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_strip(v, found, used) for v in obj)
    return obj


def _tensor_at(buffer: torch.Tensor, slot: _Slot) -> torch.Tensor:
    """The slot's tensor over a storage of its own that shares the buffer's memory (a plain
    view would carry the whole buffer into torch.save, and an offset some ops mishandle)."""
    size = buffer.element_size()
    storage = buffer.untyped_storage()[slot.offset * size:(slot.offset + _numel(slot.shape)) * size]
    return torch.empty(0, dtype=buffer.dtype).set_(storage).view(slot.shape)


def _restore(obj, buffers: Dict[str, torch.Tensor], rank: int, world: int):
    """The snapshot back from its stripped form, tensors as views of the shared buffers."""
    if isinstance(obj, _Slot):
        return _tensor_at(buffers[obj.dtype], obj)
    if isinstance(obj, _ShardedSlot):
        pieces = [(_restore(slot, buffers, rank, world), offsets) for slot, offsets in obj.shards]
        return sharded_tensors({"t": pieces}, {"t": obj.size}, rank, world)["t"]
    if isinstance(obj, dict):
        return type(obj)((k, _restore(v, buffers, rank, world)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_restore(v, buffers, rank, world) for v in obj)
    return obj


class AsyncSaver:
    """The writer process of one training run, seen from the training rank."""

    def __init__(self):
        self._proc: Optional[subprocess.Popen] = None
        self._to_writer = self._from_writer = None
        self._buffers: Dict[str, torch.Tensor] = {}
        self._sender: Optional[threading.Thread] = None
        self._send_error: Optional[BaseException] = None
        self._in_flight: Optional[int] = None
        self._rendezvous_sent = False
        self._finalizer = None

    # -- training side ------------------------------------------------------------
    def save(self, root: str, iteration: int, run: RunState) -> None:
        """Wait for the previous save, copy this one into the shared buffers, hand it over."""
        self.wait()
        rendezvous = self._rendezvous()
        self._start()
        fmt = format_named(run.config.checkpoint.ckpt_format)
        with collectives.process_group():
            messages, tree = self._stage(fmt.snapshot(root, iteration, run))
            messages.append(("save", fmt, root, iteration, tree, rendezvous))
        payload = b"".join(pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL) for m in messages)
        # the writer may still be starting: a thread waits on the pipe, not training
        self._sender = threading.Thread(target=self._send, args=(payload,), daemon=True,
                                        name=f"async-save-send-{iteration}")
        self._sender.start()
        self._in_flight = iteration

    def _start(self) -> None:
        if self._proc is not None:
            return
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
            __file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [package_root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
            OMP_NUM_THREADS="1")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "megatron.checkpointing.async_save", str(down_r), str(up_w)],
            pass_fds=(down_r, up_w), env=env, stdin=subprocess.DEVNULL)
        os.close(down_r)
        os.close(up_w)
        self._to_writer = os.fdopen(down_w, "wb")
        self._from_writer = os.fdopen(up_r, "rb")
        self._finalizer = weakref.finalize(self, _shut_down, self._proc, self._to_writer,
                                           self._from_writer, self._buffers)

    def _stage(self, snapshot) -> Tuple[list, object]:
        """Copy the snapshot's tensors into the shared buffers (one per dtype, grown when too
        small); returns (the messages mapping new buffers, the snapshot with slots)."""
        found: List[Tuple[_Slot, torch.Tensor]] = []
        used: Dict[str, int] = {}
        tree = _strip(snapshot, found, used)
        messages = []
        for dtype, numel in used.items():
            buffer = self._buffers.get(dtype)
            if buffer is None or buffer.numel() < numel:
                self._buffers[dtype] = self._allocate(dtype, numel)
                messages.append(("map", dtype, self._path(dtype), numel))
        for slot, tensor in found:
            view = self._buffers[slot.dtype][slot.offset:slot.offset + tensor.numel()]
            view.view(slot.shape).copy_(tensor.detach())
        return messages, tree

    def _path(self, dtype: str) -> str:
        return os.path.join(_SHM or tempfile.gettempdir(),
                            f"megatron-async-save-{os.getpid()}-{id(self):x}-{dtype}")

    def _allocate(self, dtype: str, numel: int) -> torch.Tensor:
        path = self._path(dtype)
        if os.path.exists(path):
            os.unlink(path)  # the writer maps the new file; its old mapping stays valid
        return torch.from_file(path, shared=True, size=numel, dtype=getattr(torch, dtype))

    def _rendezvous(self) -> Optional[tuple]:
        """Where the writers meet, once: (addr, port, prefix, rank, world); None without
        torch.distributed. Collective over the training ranks at the first save."""
        if self._rendezvous_sent or not dist.is_initialized():
            return None
        self._rendezvous_sent = True
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            raise CheckpointError("--async-save with several ranks needs MASTER_ADDR and "
                                  "MASTER_PORT (env:// rendezvous, as torchrun sets them) for "
                                  "its writer processes; launch with torchrun or drop "
                                  "--async-save")
        prefix = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(prefix, src=0)
        return addr, int(port), f"megatron-async-save/{prefix[0]}", dist.get_rank(), \
            dist.get_world_size()

    def _send(self, payload: bytes) -> None:
        try:
            self._to_writer.write(payload)
            self._to_writer.flush()
        except BaseException as err:  # the writer died: wait() reports it
            self._send_error = err

    @property
    def pending(self) -> bool:
        """Whether a save is in flight and not yet durable."""
        if self._in_flight is None:
            return False
        ready, _, _ = select.select([self._from_writer], [], [], 0)
        return not ready

    def wait(self) -> None:
        """Block until the save in flight is durable; a failed write raises CheckpointError."""
        if self._in_flight is None:
            return
        iteration, self._in_flight = self._in_flight, None
        self._sender.join()
        try:
            reply = pickle.load(self._from_writer)
        except (EOFError, OSError, pickle.UnpicklingError):
            code = self._proc.wait()
            self._close()
            raise CheckpointError(f"the checkpoint writer (--async-save) of iteration "
                                  f"{iteration} died with exit status {code} before the write "
                                  f"was complete; the tracker names the previous checkpoint")
        if reply[0] != "done":  # ("error", line, whether every writer failed alike)
            self._close()
            raise CheckpointError(f"writing checkpoint iteration {iteration} in the background "
                                  f"(--async-save) failed: {reply[1]}", agreed=reply[2])

    def _close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._proc = self._finalizer = None
        self._rendezvous_sent = False
        self._buffers = {}


def _shut_down(proc, to_writer, from_writer, buffers) -> None:
    """Tell the writer to exit (at the end of the run or after an error) and reap it."""
    try:
        pickle.dump(("exit",), to_writer)
        to_writer.close()
    except (OSError, ValueError):
        pass
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    from_writer.close()
    buffers.clear()


# -- the writer process -------------------------------------------------------------
class _Writer:
    def __init__(self):
        self.buffers: Dict[str, torch.Tensor] = {}

    def handle(self, message) -> Optional[tuple]:
        if message[0] == "map":
            _, dtype, path, numel = message
            self.buffers[dtype] = torch.from_file(path, shared=True, size=numel,
                                                  dtype=getattr(torch, dtype))
            os.unlink(path)  # both processes hold the mapping; nothing is left on exit
            return None
        _, fmt, root, iteration, tree, rendezvous = message
        if not dist.is_initialized():
            self._join(rendezvous)
        snapshot = _restore(tree, self.buffers, dist.get_rank(), dist.get_world_size())
        fmt.write(root, iteration, snapshot)
        return ("done", iteration)

    def _join(self, rendezvous) -> None:
        if rendezvous is None:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            return
        addr, port, prefix, rank, world = rendezvous
        store = dist.PrefixStore(prefix, dist.TCPStore(addr, port, is_master=False))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _writer_main(read_fd: int, write_fd: int) -> None:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.nice(19)  # training comes first on shared cores
    torch.set_num_threads(1)
    writer = _Writer()
    with os.fdopen(read_fd, "rb") as down, os.fdopen(write_fd, "wb") as up:
        while True:
            try:
                message = pickle.load(down)
            except EOFError:
                return
            if message[0] == "exit":
                return
            try:
                reply = writer.handle(message)
            except Exception as err:  # reported to the training rank, then this writer ends
                text = " ".join(f"{type(err).__name__}: {err}".split())
                pickle.dump(("error", text, getattr(err, "agreed", False)), up)
                up.flush()
                return
            if reply is not None:
                pickle.dump(reply, up)
                up.flush()


if __name__ == "__main__":  # run the module's own copy: the snapshot's slots are its classes
    from megatron.checkpointing import async_save
    async_save._writer_main(int(sys.argv[1]), int(sys.argv[2]))
