"""Megatron's checkpoint root, shared by every format:

    <root>/latest_checkpointed_iteration.txt     the iteration number, or "release"
    <root>/iter_0000100/                         one iteration (its files are the format's)
    <root>/release/                              a converted model (iteration 0)

The tracker is written last by every save (durably, see io.py), so an interrupted save
leaves the previous checkpoint as the one to resume.
"""
import os
from typing import Optional, Tuple

from megatron.checkpointing import io
from megatron.checkpointing.io import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0
"""The checkpoint_version our files carry (Megatron-LM's current one)."""


def iteration_dir(root: str, iteration: int, release: bool = False) -> str:
    return os.path.join(root, "release" if release else f"iter_{iteration:07d}")


def named_iteration(directory: str) -> Optional[Tuple[int, bool]]:
    """(iteration, release) an iteration directory's name gives (iter_XXXXXXX, release), or
    None for another name."""
    name = os.path.basename(os.path.normpath(directory))
    if name == "release":
        return 0, True
    if name.startswith("iter_") and name[5:].isdigit():
        return int(name[5:]), False
    return None


def read_tracker(root: str) -> Optional[Tuple[int, bool]]:
    """(iteration, release) from the tracker file, or None when there is no checkpoint."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"--load {root} is a file; pass the checkpoint directory (the one "
                              f"holding {TRACKER})")
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        text = f.read(64).decode("utf-8", "replace").strip()
    if text == "release":
        return 0, True
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {text[:32]!r}, not an iteration number (>= 0); "
                              f"fix or remove it")
    return int(text), False


def write_tracker(root: str, iteration: int, release: bool = False) -> None:
    io.write_text(os.path.join(root, TRACKER), "release" if release else str(iteration))
