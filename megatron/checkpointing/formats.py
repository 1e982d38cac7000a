"""What a checkpoint format provides to the front door (api.py), and what it is given.

A format is one module holding one object that satisfies `CheckpointFormat`; api.py's
registry names it in one line. The front door detects the format of a checkpoint once
(`detect` of each registered format, in registry order), and every save, load, summary
and tool goes through the object it found. Wrappers that any format takes: `--async-save`
(async_save.py: `snapshot` in the training process, `write` in a writer process) and
`--universal-checkpoint` (universal.py: `read_model`, re-cut for this rank).
"""
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Protocol, Tuple

import torch

from megatron.checkpointing.io import CheckpointError
from megatron.checkpointing.tracker import TRACKER

Flat = Dict[str, torch.Tensor]
"""Parameters by our global names (`language_model.encoder.layers.<global layer>.…`)."""


@dataclass
class RunState:
    """What a checkpoint saves and restores. Inference passes no optimizer or scheduler."""

    models: List[torch.nn.Module]
    """This rank's model chunks (one per virtual pipeline stage)."""
    config: Any
    """megatron.config.Config of the run."""
    pstate: Any
    """megatron.mpu.ParallelState of the run."""
    optimizer: Any = None
    scheduler: Any = None
    consumed_train: int = 0
    consumed_valid: int = 0

    def pipeline_split(self):
        """The run's pipeline layout as a layout string ("Ett|tL") when PP > 1, else None:
        saved with the torch format's layout, so that a checkpoint of another split is
        re-sharded (--universal-checkpoint) or refused, never loaded into the wrong layers."""
        return str(self.config.pipeline_layout()) if self.pstate.pp_size > 1 else None


@dataclass(frozen=True)
class Found:
    """Where a checkpoint's latest iteration lives and which format holds it."""

    format: "CheckpointFormat"
    root: str
    """The checkpoint directory: where the tracker is (or would be), and what the paths that
    a checkpoint stores relative to itself are relative to."""
    directory: str
    """The iteration directory (iter_XXXXXXX, release, or a bare directory given itself)."""
    iteration: int
    release: bool = False
    tracked: bool = True
    """False: `directory` was given itself, without a tracker (a run's iter_XXXXXXX, or a bare
    directory of Megatron-Core's `dist_checkpointing.save`); `iteration` is then its name's,
    else the one it stores (0 when it stores none)."""
    model: Optional[dict] = None
    """ModelConfig fields that the caller gives (a tool's model flags), for a checkpoint that
    stores no model configuration."""

    def check_iteration(self, stored, path: str) -> None:
        """Refuse a file that holds another iteration than the tracker (or the directory's
        name) says this is: a mixed-up directory, never loaded as the iteration it claims."""
        if self.release or stored is None or int(stored) == self.iteration:
            return
        claim = f"{TRACKER} says" if self.tracked else "its directory name says"
        raise CheckpointError(f"{path} holds iteration {int(stored)} but {claim} "
                              f"{self.iteration}: the directory was mixed up; fix the tracker "
                              f"or restore {os.path.basename(self.directory)}")


@dataclass(frozen=True)
class Target:
    """The layout a whole model is written at (`write_model`). Formats that re-shard at
    load ignore it, and refuse expert settings they cannot use."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    """Expert tensor parallelism (None: TP)."""


Counters = Tuple[int, int, int]
"""(iteration, consumed train samples, consumed valid samples) a load resumes from."""


class CheckpointFormat(Protocol):
    """One way of laying out a checkpoint iteration on disk.

    Every method that takes a `RunState` is collective over all ranks of the run; the
    rest run in one process. Problems raise io.CheckpointError with one line that names
    the path and the fix; nothing here exits or prints beyond the documented notices."""

    name: str
    """Its name in the registry and in the loading line."""
    ckpt_format: str
    """The --ckpt-format value that saves it (or, for a read-only format, reads it)."""

    def detect(self, directory: str) -> bool:
        """Whether the iteration `directory` holds a checkpoint of this format."""

    def stored_state(self, found: Found) -> Dict[str, Any]:
        """What the iteration stores besides tensors, unverified: `config` (our
        Config.to_dict(), or {} when it has none), `parallel` (its saved sizes), and where
        known `iteration`, `consumed_train_samples`, `tokenizer_files`."""

    def snapshot(self, root: str, iteration: int, run: RunState) -> Any:
        """This rank's part of a save, collective: a tree of dicts, lists and tuples whose
        tensor leaves (torch.Tensor, or DCP's ShardedTensor) may be views of the live
        model; `write` takes it back. Clears what killed saves left under `root`."""

    def write(self, root: str, iteration: int, snapshot: Any) -> None:
        """Write this rank's snapshot, then (rank 0, once all are durable) the tracker.
        Collective over the writing processes (the run's, or the async writers')."""

    def load(self, found: Found, run: RunState) -> Counters:
        """Restore the models (and optimizer, scheduler, RNG as the flags ask) at this
        run's layout; (0, 0, 0) with --finetune or for a release."""

    def read_model(self, found: Found) -> Tuple[Flat, Dict[str, Any]]:
        """The whole model as full (TP 1) tensors with global layer numbers, and the stored
        state (as `stored_state`, plus `sharding`: each parameter's sharding metadata),
        refused as `load` refuses (digests, `found.check_iteration`, nan/inf values)."""

    def write_model(self, save: str, full: Flat, stored: Dict[str, Any],
                    target: Target) -> str:
        """Write a whole model (`read_model`'s output) as a checkpoint under `save` at
        `target`, weights and counters only; returns the iteration directory."""
