"""--ckpt-format torch_dist: Megatron-Core's checkpoint format, through torch.distributed.checkpoint.

    <root>/latest_checkpointed_iteration.txt
    <root>/iter_0000100/.metadata           DCP's global metadata (every chunk of every key)
    <root>/iter_0000100/__R_K.distcp        the chunks rank R wrote
    <root>/iter_0000100/common.pt           iteration, config, lr schedule, optimizer step and
                                            hyper-parameters, every rank's RNG state
    <root>/iter_0000100/metadata.json       {"sharded_backend": "torch_dist", ...}
    <root>/iter_0000100/checksums.sha256    sha256sum of every file above (sha256sum -c)

Every rank writes only its own chunks, with global offsets from the sharding metadata, under
Megatron-Core's keys (mcore_keys.py, dist_state.py); replicas (DP, replicated parameters) are
written once. At load every rank asks for the chunks of the layout it runs, whatever the saved
TP / PP / DP / virtual-PP layout was, and reads only those: weights and optimizer state
(fp32 main parameters, both Adam moments, distributed-optimizer pieces) re-shard alike. The
RNG state is restored when the layout is unchanged.

The iteration is written to a staging directory and renamed when complete and fsynced; the
tracker moves last, so an interrupted save leaves the previous checkpoint. DCP's `.metadata`
is a pickle: it is read with an unpickler that admits DCP's metadata classes only, and
tensors are read with torch.load(weights_only=True).
"""
import contextlib
import hashlib
import json
import os
import pickle
import shutil
import warnings
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from megatron.checkpointing import dist_state, io
from megatron.checkpointing.io import CheckpointError

# DCP warns at every ShardedTensor (deprecated in favour of DTensor, which cannot express
# the fused QKV / gated-MLP blocks) and at every single-process save: say it once here.
warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating "
                        "ShardedTensor", category=FutureWarning)
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)

METADATA_JSON = "metadata.json"
COMMON = "common.pt"
CHECKSUMS = "checksums.sha256"
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
           "common_backend": "torch", "common_backend_version": 1}
TRACKER = "latest_checkpointed_iteration.txt"
STAGING_SUFFIX = ".torch_dist.tmp"


def iteration_dir(root: str, iteration: int, release: bool = False) -> str:
    return os.path.join(root, "release" if release else f"iter_{iteration:07d}")


# -- collectives that also run in one plain process ------------------------------------
def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _gather(obj, group=None) -> Optional[list]:
    """Every rank's `obj` on rank 0 (None elsewhere)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * _world() if _rank() == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


@contextlib.contextmanager
def process_group():
    """A one-rank gloo group for the block when torch.distributed is not started (a plain
    single process: DCP's ShardedTensors need a default group)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _all_gather(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


def is_torch_dist(directory: str) -> bool:
    """Whether an iteration directory holds a torch_dist checkpoint (ours or Megatron-Core's)."""
    path = os.path.join(directory, METADATA_JSON)
    if not os.path.isfile(path):
        return False
    try:
        with open(path) as f:
            return json.load(f).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError, AttributeError):
        return False


# -- reading DCP metadata safely ----------------------------------------------------
_DCP_MODULES = "torch.distributed.checkpoint."
_PATHS = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path")


class _MetadataUnpickler(pickle.Unpickler):
    """Admits the classes of DCP's metadata (and torch.Size, dtypes, layouts, paths,
    OrderedDict): constructing those runs no code of the file's choosing."""

    def find_class(self, module, name):
        if module == "torch" and (name == "Size" or isinstance(
                getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))):
            return getattr(torch, name)
        allowed = ((module == "pathlib" and name in _PATHS)
                   or (module == "torch.serialization" and name == "_get_layout")
                   or (module == "collections" and name == "OrderedDict")
                   or (module == "builtins" and name in ("set", "frozenset")))
        if allowed:
            return super().find_class(module, name)
        if module.startswith(_DCP_MODULES):
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


class SafeReader(FileSystemReader):
    """FileSystemReader whose `.metadata` pickle may hold DCP's metadata classes only."""

    def read_metadata(self, *args, **kwargs):
        path = os.path.join(str(self.path), ".metadata")
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing; the torch_dist checkpoint is "
                                  f"incomplete") from None
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as err:
            raise CheckpointError(f"{path} cannot be read as DCP metadata ({err}); the "
                                  f"checkpoint is corrupt or not a torch_dist one") from None
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


# -- checksums ----------------------------------------------------------------------
def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _my_files(directory: str, rank: int) -> list:
    names = [n for n in os.listdir(directory) if n.startswith(f"__{rank}_") and
             n.endswith(".distcp")]
    return sorted(names + ([".metadata"] if rank == 0 else []))


def _write_checksums(directory: str, rank: int, group=None) -> None:
    """Each rank hashes what it wrote; rank 0 writes the manifest."""
    lines = [f"{_sha256(os.path.join(directory, n))}  {n}\n" for n in _my_files(directory, rank)]
    gathered = _gather(lines, group)
    if rank == 0:
        text = "".join(line for part in gathered for line in part)
        io.write_text(os.path.join(directory, CHECKSUMS), text)


def verify_checksums(directory: str) -> None:
    """Every rank checks its share of the files in the manifest; any mismatch stops all."""
    path = os.path.join(directory, CHECKSUMS)
    problem = None
    if os.path.isfile(path):
        with open(path) as f:
            entries = [line.rstrip("\n").split("  ", 1) for line in f if line.strip()]
        rank, world = _rank(), _world()
        for digest, name in entries[rank::world]:
            file = os.path.join(directory, name)
            if not os.path.isfile(file):
                problem = f"{file} is missing; the torch_dist checkpoint is incomplete"
            elif _sha256(file) != digest:
                problem = (f"{file} does not match its checksum in {path}: the file is corrupt; "
                           f"restore it or load an earlier iteration (--no-verify-checkpoint "
                           f"loads it anyway)")
    found = [p for p in _all_gather(problem) if p]
    if found:
        raise CheckpointError(found[0])


# -- save ---------------------------------------------------------------------------
def _rng_states(pstate) -> Optional[dict]:
    from megatron.checkpointing.layout import rng_state
    mine = (_rank_key(pstate), rng_state())
    gathered = _gather(mine)
    return dict(gathered) if gathered is not None else None


def _rank_key(pstate) -> str:
    """This rank's key in the saved RNG states; the CP rank is named when CP > 1 (keys of
    checkpoints saved without CP stay as they were)."""
    key = f"tp{pstate.tp_rank:03d}_pp{pstate.pp_rank:03d}_dp{pstate.dp_rank:03d}"
    return key + (f"_cp{pstate.cp_rank:03d}" if pstate.cp_size > 1 else "")


def _layout(pstate, num_chunks: int) -> dict:
    return {"tensor_model_parallel_size": pstate.tp_size,
            "pipeline_model_parallel_size": pstate.pp_size,
            "data_parallel_size": pstate.dp_size,
            "expert_model_parallel_size": pstate.ep_size,
            "virtual_pipeline_model_parallel_size": num_chunks}


def sharded_state(models, optimizer, config, pstate, saving: bool, with_optimizer: bool):
    """({key: ShardedTensor}, the optimizer tensors or None) of this rank."""
    entries = dist_state.model_entries(models, pstate, config.model.num_layers)
    state = dist_state.model_state(entries, _rank(), _world(), saving)
    tensors = None
    if with_optimizer:
        moments = dist_state.moment_names(optimizer)
        tensors = dist_state.OptimizerTensors(optimizer, entries, moments, fresh=not saving)
        state.update(tensors.state(_rank(), _world(), saving))
    return state, tensors


def common_state(iteration, models, optimizer, scheduler, config, pstate, consumed_train,
                 consumed_valid, with_optimizer: bool, rng: Optional[dict]) -> dict:
    from megatron.checkpointing.layout import CHECKPOINT_VERSION
    common = {"iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION,
              "config": config.to_dict(), "consumed_train_samples": consumed_train,
              "consumed_valid_samples": consumed_valid, "parallel": _layout(pstate, len(models))}
    if with_optimizer:
        common["optimizer"] = dist_state.optimizer_common(optimizer,
                                                          dist_state.moment_names(optimizer))
        common["opt_param_scheduler"] = scheduler.state_dict()
    if rng is not None:
        common["rng_state"] = rng
    return common


def save_checkpoint(root: str, iteration: int, models, optimizer, scheduler, config, pstate,
                    consumed_train: int, consumed_valid: int) -> None:
    """Write this rank's chunks; rank 0 the common state, then rename and move the tracker."""
    with process_group():
        prepare_iteration(root)
        _barrier()
        state, common = snapshot(iteration, models, optimizer, scheduler, config, pstate,
                                 consumed_train, consumed_valid)
        write_iteration(root, iteration, state, common)


def snapshot(iteration: int, models, optimizer, scheduler, config, pstate, consumed_train: int,
             consumed_valid: int):
    """(sharded state: views of the live tensors, common state) of this rank. Collective
    (the RNG states go to rank 0)."""
    ckpt = config.checkpoint
    with_optimizer = not ckpt.no_save_optim
    state, _ = sharded_state(models, optimizer, config, pstate, True, with_optimizer)
    rng = None if ckpt.no_save_rng else _rng_states(pstate)
    common = common_state(iteration, models, optimizer, scheduler, config, pstate,
                          consumed_train, consumed_valid, with_optimizer, rng)
    return state, common


def staging_dir(root: str, final: str) -> str:
    return os.path.join(root, f".{final}{STAGING_SUFFIX}")


def remove_stale_staging(root: str) -> None:
    """Staging directories of saves killed before their rename (call with no save running)."""
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.endswith(STAGING_SUFFIX) or name.endswith(".old.tmp"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def prepare_iteration(root: str) -> None:
    """Rank 0 clears what killed saves left (before a save's first collective)."""
    if _rank() == 0:
        io.remove_stale_temp_files(root)
        remove_stale_staging(root)


def write_iteration(root: str, iteration: Optional[int], state: dict, common: dict,
                    final: Optional[str] = None, group=None) -> None:
    """Collective over `group` (default: all ranks): the DCP files of `state`, rank 0's
    `common`, the rename, the tracker (without an `iteration`: to `root/final`, no tracker).
    Call `prepare_iteration` first, while no other save runs."""
    final = final or os.path.basename(iteration_dir(root, iteration))
    rank, staging = _rank(), staging_dir(root, final)
    if rank == 0:
        os.makedirs(staging)
    _barrier(group)
    dcp.save(state, storage_writer=FileSystemWriter(staging, sync_files=True,
                                                    single_file_per_rank=True),
             planner=DefaultSavePlanner(), process_group=group,
             no_dist=not dist.is_initialized())
    _write_checksums(staging, rank, group)
    if rank == 0:
        io.save_file(common, os.path.join(staging, COMMON))
        io.write_text(os.path.join(staging, METADATA_JSON), json.dumps(BACKEND))
        io.fsync_dir(staging)
        _publish(root, staging, os.path.join(root, final))
        if iteration is not None:
            io.write_text(os.path.join(root, TRACKER), str(iteration))
    _barrier(group)


def _publish(root: str, staging: str, final: str) -> None:
    """Rename the complete staging directory to its final name (replacing an older save
    of the same iteration only after the new one is complete)."""
    old = None
    if os.path.exists(final):
        old = final + ".old.tmp"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staging, final)
    io.fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# -- load ---------------------------------------------------------------------------
def read_common(directory: str, verify: bool) -> dict:
    common = io.load_file(os.path.join(directory, COMMON), verify)
    if not isinstance(common, dict):
        raise CheckpointError(f"{directory}/{COMMON} holds a {type(common).__name__}, not a "
                              f"dict")
    return common


def stored_common(root: str) -> Optional[dict]:
    """common.pt of the latest torch_dist iteration under `root` (unverified; {} for a
    Megatron-Core checkpoint without one); None when it is not torch_dist."""
    from megatron.checkpointing.layout import read_tracker
    tracked = read_tracker(root)
    directory = iteration_dir(root, *tracked) if tracked is not None else None
    if directory is None or not is_torch_dist(directory):
        return None
    if not os.path.isfile(os.path.join(directory, COMMON)):
        return {}
    return read_common(directory, verify=False)


def check_keys(state: dict, metadata, directory: str, what: str) -> None:
    """Every requested key is in the checkpoint with the global shape this run needs."""
    saved = metadata.state_dict_metadata
    for key, value in state.items():
        if key not in saved:
            raise CheckpointError(f"{directory} has no {key!r} ({what}); check the model flags "
                                  f"(or load the weights only with --no-load-optim)")
        size = tuple(getattr(saved[key], "size", ()))
        needed = tuple(value.metadata().size)
        if size != needed:
            raise CheckpointError(f"{directory}: {key!r} has shape {list(size)}, this run needs "
                                  f"{list(needed)}; check the model flags")


def load_sharded(directory: str, state: dict) -> None:
    """Fill `state` (this rank's ShardedTensors) from the checkpoint: collective."""
    dcp.load(state, storage_reader=SafeReader(directory), planner=DefaultLoadPlanner(),
             no_dist=not dist.is_initialized())


def load_model_weights(directory: str, models, num_layers: int, pstate) -> None:
    """Only the weights of a torch_dist iteration directory (ours or Megatron-Core's), at this
    run's layout: collective over all ranks."""
    with process_group():
        entries = dist_state.model_entries(models, pstate, num_layers)
        state = dist_state.model_state(entries, _rank(), _world(), saving=False)
        check_keys(state, SafeReader(directory).read_metadata(), directory, "a model weight")
        with torch.no_grad():
            load_sharded(directory, state)


def save_model_weights(directory: str, models, num_layers: int, pstate) -> None:
    """Only the weights, as a torch_dist iteration directory (no tracker, no common state
    beyond the format's metadata): collective over all ranks."""
    with process_group():
        entries = dist_state.model_entries(models, pstate, num_layers)
        state = dist_state.model_state(entries, _rank(), _world(), saving=True)
        root, name = os.path.split(os.path.abspath(directory))
        prepare_iteration(root)
        _barrier()
        write_iteration(root, None, state, {}, final=name)


def load_checkpoint(root: str, directory: str, release: bool, models, optimizer, scheduler,
                    config, pstate):
    """Restore a torch_dist iteration at this run's layout; returns the counters."""
    with process_group():
        return _load(root, directory, release, models, optimizer, scheduler, config, pstate)


def _load(root, directory, release, models, optimizer, scheduler, config, pstate):
    ckpt = config.checkpoint
    if ckpt.verify_checkpoint:
        verify_checksums(directory)
    common = read_common(directory, ckpt.verify_checkpoint) \
        if os.path.isfile(os.path.join(directory, COMMON)) else {}
    ours = "consumed_train_samples" in common
    saved_optim = common.get("optimizer")
    with_optimizer = (ours and not ckpt.no_load_optim and not ckpt.finetune and not release
                      and optimizer is not None)
    if with_optimizer and saved_optim is None:
        raise CheckpointError(f"{root} has no optimizer state (saved with --no-save-optim); "
                              f"load it with --no-load-optim or --finetune")
    if with_optimizer:  # the moments saved, not those of this fresh optimizer
        optimizer_moments = saved_optim["moments"]
        entries = dist_state.model_entries(models, pstate, config.model.num_layers)
        tensors = dist_state.OptimizerTensors(optimizer, entries, optimizer_moments, fresh=True)
    state, _ = sharded_state(models, optimizer, config, pstate, False, False)
    metadata = SafeReader(directory).read_metadata()
    check_keys(state, metadata, directory, "a model weight")
    have_fp32 = False
    if with_optimizer:
        optim_state = tensors.state(_rank(), _world(), saving=False)
        fp32 = {k: v for k, v in optim_state.items() if f".{dist_state.FP32}." in k}
        have_fp32 = bool(fp32) and all(k in metadata.state_dict_metadata for k in fp32)
        if not have_fp32:
            optim_state = {k: v for k, v in optim_state.items() if k not in fp32}
        check_keys(optim_state, metadata, directory, "optimizer state")
        state.update(optim_state)
    with torch.no_grad():
        load_sharded(directory, state)
    if optimizer is not None:
        optimizer.reload_model_params()
    if not ours:
        if pstate.rank == 0:
            print(f" > loaded the weights of the torch_dist checkpoint {directory} (no state of "
                  f"this framework: optimizer, schedule and counters start fresh)", flush=True)
        return 0, 0, 0
    if ckpt.finetune or release:
        return 0, 0, 0
    if with_optimizer:
        load = dist_state.load_distributed if optimizer.is_distributed else dist_state.load_regular
        load(optimizer, tensors, saved_optim, have_fp32)
        scheduler.load_state_dict(common["opt_param_scheduler"])
    _restore_rng(common, pstate, len(models), ckpt)
    return (int(common["iteration"]), int(common.get("consumed_train_samples", 0)),
            int(common.get("consumed_valid_samples", 0)))


def _restore_rng(common: dict, pstate, num_chunks: int, ckpt) -> None:
    from megatron.checkpointing.layout import set_rng_state
    states = common.get("rng_state")
    if ckpt.no_load_rng or not states:
        return
    if common.get("parallel") == _layout(pstate, num_chunks) and _rank_key(pstate) in states:
        set_rng_state(states[_rank_key(pstate)])
    elif pstate.rank == 0:
        print(" > torch_dist: the checkpoint was saved at another layout; the RNG state "
              "starts from the seed", flush=True)


def torch_dist_iteration(root: str, ckpt) -> Optional[tuple]:
    """(iteration directory, release) when --load must read torch_dist, None for the torch
    format or no checkpoint; a format other than --ckpt-format is an error unless
    --auto-detect-ckpt-format."""
    from megatron.checkpointing.layout import read_tracker
    tracked = read_tracker(root)
    if tracked is None:
        return None
    directory = iteration_dir(root, *tracked)
    found = "torch_dist" if is_torch_dist(directory) else "torch"
    if found != ckpt.ckpt_format and not ckpt.auto_detect_ckpt_format:
        raise CheckpointError(f"{directory} is a {found} checkpoint but --ckpt-format is "
                              f"{ckpt.ckpt_format}; pass --ckpt-format {found} or "
                              f"--auto-detect-ckpt-format")
    return (directory, tracked[1]) if found == "torch_dist" else None
