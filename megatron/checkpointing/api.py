"""The front door to checkpoints: every save, load, detection and conversion goes through here.

    detect(root)                    -> Found (format, iteration directory) or None; `root` may
                                       be an iteration directory itself (`notice`)
    save(root, iteration, run)      write an iteration in --ckpt-format (collective)
    load(root, run)                 restore the latest iteration at this run's layout (collective)
    stored_state(root)              its config, layout and counters (no tensors)
    read_model(root)                the whole model as full tensors, any format
    convert(load, save, name, target)   re-shard or convert to another format (one process)

`FORMATS` is the registry: each entry is one module's object that satisfies
formats.CheckpointFormat, in detection order (the first whose `detect` claims an iteration
directory holds it). Adding a format is its module and one line here. `--universal-checkpoint`
(universal.py) and `--async-save` (async_save.py) are wrappers that any format takes.
"""
import dataclasses
import os
from typing import Any, Dict, List, Optional, Tuple

from megatron.checkpointing import (collectives, megatron_lm, portable, torch_dcp, torch_dist,
                                   torch_format, universal)
from megatron.checkpointing.formats import (CheckpointFormat, Counters, Flat, Found, RunState,
                                            Target)
from megatron.checkpointing.io import CheckpointError
from megatron.checkpointing.tracker import TRACKER, iteration_dir, named_iteration, read_tracker

FORMATS: List[CheckpointFormat] = [
    torch_dist.FORMAT,
    torch_dcp.FORMAT,
    megatron_lm.FORMAT,
    torch_format.FORMAT,
]


def format_named(name: str) -> CheckpointFormat:
    """The format that --ckpt-format `name` saves."""
    for fmt in FORMATS:
        if fmt.name == name:
            return fmt
    raise CheckpointError(f"--ckpt-format {name} is not a checkpoint format; choose one of "
                          f"{', '.join(saved_formats())}")


def saved_formats() -> List[str]:
    """The --ckpt-format choices."""
    return sorted({fmt.ckpt_format for fmt in FORMATS})


def detect_directory(directory: str) -> Optional[CheckpointFormat]:
    """The format of one iteration directory (None: none of the registered ones)."""
    for fmt in FORMATS:
        if fmt.detect(directory):
            return fmt
    return None


def detect(root: str, model: Optional[dict] = None) -> Optional[Found]:
    """The latest iteration under the checkpoint directory `root` and its format; None when
    `root` holds no checkpoint. Without a tracker, `root` may be one iteration directory
    itself (a run's iter_XXXXXXX or release, or a bare directory of Megatron-Core's
    `dist_checkpointing.save`): Found.tracked is then False (see `notice`). A directory that
    holds iteration directories but no tracker is refused, never taken for an empty one.
    `model`: Found.model, the caller's model flags for a checkpoint that stores none."""
    tracked = read_tracker(root)
    if tracked is None:
        return _untracked(root, model)
    directory = iteration_dir(root, *tracked)
    fmt = detect_directory(directory)
    if fmt is None:
        listed = sorted(os.listdir(directory)) if os.path.isdir(directory) else "nothing"
        raise CheckpointError(f"{os.path.join(root, TRACKER)} names {directory}, which holds "
                              f"no checkpoint of a known format (found {listed}): the checkpoint "
                              f"is incomplete; restore it or fix the tracker")
    return Found(fmt, root, directory, *tracked, model=model)


def _untracked(directory: str, model: Optional[dict]) -> Optional[Found]:
    """A `directory` without a tracker: an iteration directory given itself, or None."""
    if not os.path.isdir(directory):
        return None
    fmt = detect_directory(directory)
    if fmt is None:
        _refuse_untracked_iterations(directory)
        return None
    named = named_iteration(directory)
    root = os.path.dirname(os.path.normpath(directory)) if named else directory
    found = Found(fmt, root, directory, *(named or (0, False)), tracked=False, model=model)
    if named is None:
        stored = fmt.stored_state(found).get("iteration")
        found = dataclasses.replace(found, iteration=int(stored or 0))
    return found


def _refuse_untracked_iterations(root: str) -> None:
    """A directory without a tracker that holds checkpoint directories is never taken for an
    empty one: refused, naming the one to pass (the latest iteration, else the first)."""
    held = sorted(name for name in os.listdir(root) if os.path.isdir(os.path.join(root, name))
                  and detect_directory(os.path.join(root, name)) is not None)
    if held:
        iterations = sorted((named_iteration(name)[0], name) for name in held
                            if named_iteration(name))
        chosen = iterations[-1][1] if iterations else held[0]
        raise CheckpointError(f"{root} holds {', '.join(held)} but no {TRACKER}; pass --load "
                              f"{os.path.join(root, chosen)} to load that checkpoint directory, "
                              f"or restore the tracker")


def notice(found: Found) -> Optional[str]:
    """The one-line notice of a checkpoint given as an iteration directory (None otherwise)."""
    if found.tracked:
        return None
    return (f" > {found.directory} has no {TRACKER}: it is loaded as one {found.format.name} "
            f"checkpoint directory, iteration {found.iteration}")


def check_format(found: Found, ckpt) -> Found:
    """`found`, when --ckpt-format allows reading it."""
    if found.format.ckpt_format != ckpt.ckpt_format and not ckpt.auto_detect_ckpt_format:
        raise CheckpointError(f"{found.directory} is a {found.format.ckpt_format} checkpoint but "
                              f"--ckpt-format is {ckpt.ckpt_format}; pass --ckpt-format "
                              f"{found.format.ckpt_format} or --auto-detect-ckpt-format")
    return found


def save(root: str, iteration: int, run: RunState) -> None:
    """Write iteration `iteration` of `run` under `root` in --ckpt-format: collective."""
    fmt = format_named(run.config.checkpoint.ckpt_format)
    with collectives.process_group():
        fmt.write(root, iteration, fmt.snapshot(root, iteration, run))


def load(root: str, run: RunState, inference: bool = False) -> Optional[Counters]:
    """Restore the latest iteration under `root` into `run`: collective. None when there is
    no checkpoint. It must be in --ckpt-format (or --auto-detect-ckpt-format) and saved at
    this run's layout, unless its format re-shards at load or --universal-checkpoint is
    given. `inference`: the weights of any format, re-sharded in memory when needed."""
    found = detect(root)
    if found is None:
        return None
    if not inference:
        check_format(found, run.config.checkpoint)
    with collectives.process_group():
        if (run.config.checkpoint.universal_checkpoint or inference) \
                and not found.format.reshards_on_load:
            return universal.load(found, run, inference)
        return found.format.load(found, run)


def stored_state(root: str) -> Dict[str, Any]:
    """What the latest iteration under `root` stores besides tensors (formats.CheckpointFormat
    .stored_state), unverified; a CheckpointError when there is no checkpoint."""
    found = found_or_error(root)
    return found.format.stored_state(found)


def found_or_error(root: str, model: Optional[dict] = None) -> Found:
    found = detect(root, model)
    if found is None:
        raise CheckpointError(f"no checkpoint at {root}: {os.path.join(root, TRACKER)} is "
                              f"missing; pass the --save directory of a training run (or one "
                              f"of its iteration directories)")
    return found


def loading_lines(found: Found) -> List[str]:
    """What an entry point prints before it loads `found`: the notice of a directory given
    without a tracker, then " loading checkpoint from <root> at iteration N (format ...,
    saved at TP t x PP p)"."""
    parallel = found.format.stored_state(found).get("parallel") or {}
    tp, pp = (parallel.get(f"{k}_model_parallel_size", "?") for k in ("tensor", "pipeline"))
    kind = "release" if found.release else found.format.name
    line = (f" loading checkpoint from {found.directory if not found.tracked else found.root} "
            f"at iteration {found.iteration} (format {kind}, saved at TP {tp} x PP {pp})")
    return [text for text in (notice(found), line) if text]


def read_model(root: str, model: Optional[dict] = None) -> Tuple[Flat, Dict[str, Any]]:
    """The whole model of the latest iteration under `root` (full tensors, global layer
    numbers) and its stored state, whatever its format, checked as --load checks it (digests,
    the stored iteration, finite values). `model`: ModelConfig fields for a checkpoint that
    stores no configuration (Found.model). One process."""
    found = found_or_error(root, model)
    with collectives.process_group():
        return found.format.read_model(found)


def write_model(save: str, full: Flat, stored: Dict[str, Any], name: str = "torch",
                target: Target = Target()) -> str:
    """Write a whole model as a checkpoint of format `name` under `save` at `target`. One
    process; returns the iteration directory."""
    fmt = format_named(name)
    with collectives.process_group():
        return fmt.write_model(save, full, stored, target)


def convert(load: str, save: str, name: str, target: Target = Target(),
            model: Optional[dict] = None) -> str:
    """The latest iteration under `load` re-sharded to `target` and written as format `name`
    under `save` (weights and counters; the input is only read and checked as by
    `read_model`; `model` as there)."""
    found = found_or_error(load, model)
    fmt = format_named(name)
    if os.path.realpath(load) == os.path.realpath(save):
        raise CheckpointError(f"--save {save} is the --load directory; write the converted "
                              f"checkpoint elsewhere (the input is never modified)")
    if found.format is fmt and fmt.reshards_on_load:
        raise CheckpointError(f"{load} is already {fmt.name}, which re-shards at load; there "
                              f"is nothing to convert")
    with collectives.process_group():
        full, stored = found.format.read_model(found)
        path = fmt.write_model(save, full, stored, target)
    portable.copy_origin_files(found.root, save)
    return path
