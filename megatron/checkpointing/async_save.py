"""--async-save: torch_dist checkpoints written in the background while training goes on.

At a save every rank takes a CPU copy of its chunks and the common state (the only part
that blocks training), then a thread writes them with torch.distributed.checkpoint. The
thread's collectives run on a gloo group of their own, so they never interleave with the
training's. The write is the synchronous one (staging directory, fsync, checksums,
rename), so the tracker moves only once the new iteration is complete and durable; a
process killed during the write leaves the previous checkpoint as the one to resume.

One save is in flight at a time: the next save, the end of training and a stop on a signal
(--exit-signal-handler) wait for it first (`wait`), and a failed write is raised there.
"""
import threading
from typing import Optional

import torch.distributed as dist

from megatron.checkpointing import torch_dist


class AsyncSaver:
    """The background writer of one training run."""

    def __init__(self):
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._group = None
        self._own_group = False

    def save(self, root: str, iteration: int, models, optimizer, scheduler, config, pstate,
             consumed_train: int, consumed_valid: int) -> None:
        """Wait for the previous save, copy this one, and start writing it."""
        self.wait()
        with self._process_group():
            torch_dist.prepare_iteration(root)
            if dist.is_initialized():
                dist.barrier()
            state, common = torch_dist.snapshot(iteration, models, optimizer, scheduler, config,
                                                pstate, consumed_train, consumed_valid,
                                                copy=True)
        self._thread = threading.Thread(target=self._write, args=(root, iteration, state, common),
                                        name=f"async-save-{iteration}", daemon=True)
        self._thread.start()

    def _process_group(self):
        """In a plain process: the one-rank group DCP's ShardedTensors need, for the copy;
        the write then runs without one. With several ranks: a gloo group for the writes."""
        if dist.is_initialized() and self._group is None:
            self._group = dist.new_group(backend="gloo")
        return torch_dist.process_group()

    def _write(self, root, iteration, state, common) -> None:
        try:
            torch_dist.write_iteration(root, iteration, state, common, group=self._group)
        except BaseException as err:  # raised in the training thread by wait()
            self._error = err

    @property
    def pending(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the save in flight is durable; raise its error, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
