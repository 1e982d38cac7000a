"""The files of one DCP (torch.distributed.checkpoint) iteration directory, as Megatron-Core
writes them: how they are recognised, read safely, checksummed, staged and published.

    .metadata          DCP's global metadata (a pickle: read with an unpickler that admits
                       DCP's metadata classes only)
    __R_K.distcp       the chunks rank R wrote
    common.pt          the state that is not sharded (torch.load(weights_only=True))
    metadata.json      {"sharded_backend": "torch_dist", ...}
    checksums.sha256   sha256sum of the files above (ours; `sha256sum -c` checks it)

A directory is written under a staging name and renamed when complete and fsynced
(`write_iteration`); the format that uses these files is torch_dist.py.
"""
import contextlib
import errno
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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from megatron.checkpointing import collectives, io
from megatron.checkpointing.io import CheckpointError
from megatron.files import KeepsWriteError, file_sha256, fsync_dir, publish
from megatron.checkpointing.tracker import iteration_dir, write_tracker

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
STAGING_SUFFIX = ".torch_dist.tmp"


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
def _my_files(directory: str, rank: int) -> list:
    names = [n for n in os.listdir(directory) if n.startswith(f"__{rank}_") and
             n.endswith(".distcp")]
    return sorted(names + ([".metadata"] if rank == 0 else []))


def _checksum_lines(directory: str, rank: int) -> list:
    """This rank's manifest lines: the sha256 of the files it wrote."""
    return [f"{file_sha256(os.path.join(directory, n))}  {n}\n" for n in _my_files(directory, rank)]


def written_here(common: dict) -> bool:
    """Whether a common.pt is this framework's (it carries our digest, config or counters).
    Megatron-Core's (`{}` from `dist_checkpointing.save`, Megatron-LM's args and schedule
    from a training run) carries none: like Megatron-LM's legacy files it is read unverified,
    and its directory has no manifest."""
    return any(key in common for key in (io.CONTENT_DIGEST, "config", "consumed_train_samples"))


def verify_checksums(directory: str, required: bool = True) -> None:
    """Every rank checks its share of the files in the manifest; any mismatch stops all.
    Without a manifest: refused when `required` (a checkpoint of ours), else nothing to do."""
    path = os.path.join(directory, CHECKSUMS)
    problem = None
    if not os.path.isfile(path) and required:
        problem = (f"{path} is missing, so the torch_dist checkpoint's files cannot be verified; "
                   f"restore it, or pass --no-verify-checkpoint to load them unverified")
    elif os.path.isfile(path):
        with open(path) as f:
            entries = [line.rstrip("\n").split("  ", 1) for line in f if line.strip()]
        rank, world = collectives.rank(), collectives.world()
        for digest, name in entries[rank::world]:
            file = os.path.join(directory, name)
            if not os.path.isfile(file):
                problem = f"{file} is missing; the torch_dist checkpoint is incomplete"
            elif file_sha256(file) != digest:
                problem = (f"{file} does not match its checksum in {path}: the file is corrupt; "
                           f"restore it or load an earlier iteration (--no-verify-checkpoint "
                           f"loads it anyway)")
    found = [p for p in collectives.all_gather(problem) if p]
    if found:
        raise CheckpointError(found[0])


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
    if collectives.rank() == 0:
        io.remove_stale_temp_files(root)
        remove_stale_staging(root)


def write_iteration(root: str, iteration: Optional[int], state: dict, common: Optional[dict],
                    final: Optional[str] = None, group=None) -> None:
    """Collective over `group` (default: all ranks): the DCP files of `state`, rank 0's
    `common` (common.pt and metadata.json; None: neither, a bare DCP checkpoint), the rename,
    the tracker (without an `iteration`: to `root/final`, no tracker).
    Call `prepare_iteration` first, while no other save runs. A failure on any rank (a full
    disk: ENOSPC named) is raised on every rank alike (collectives.agreed), after the staging
    directory is removed: the previous checkpoint stays the tracked one."""
    final = final or os.path.basename(iteration_dir(root, iteration))
    rank, staging = collectives.rank(), staging_dir(root, final)
    what = f"saving {os.path.join(root, final)}"
    try:
        with collectives.agreed(what, group):
            if rank == 0:
                os.makedirs(staging)
        with collectives.agreed(what, group):
            _dcp_save(state, root, staging, group)
            lines = _checksum_lines(staging, rank)
        gathered = collectives.gather(lines, group)
        with collectives.agreed(what, group):
            if rank == 0:
                _finish(root, staging, final, iteration, common, gathered)
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def _finish(root: str, staging: str, final: str, iteration: Optional[int],
            common: Optional[dict], checksums: list) -> None:
    """Rank 0: the manifest, common.pt and metadata.json (unless `common` is None), then the
    rename and the tracker."""
    io.write_text(os.path.join(staging, CHECKSUMS), "".join(line for part in checksums
                                                            for line in part))
    if common is not None:
        io.save_file(common, os.path.join(staging, COMMON))
        io.write_text(os.path.join(staging, METADATA_JSON), json.dumps(BACKEND))
    fsync_dir(staging)
    _publish(root, staging, os.path.join(root, final))
    if iteration is not None:
        write_tracker(root, iteration)


class _KeepingFileSystem(FileSystem):
    """DCP's file system, whose streams keep the first OSError a write met (files.
    KeepsWriteError): torch.save inside DCP turns a full disk into 'unexpected pos'."""

    def __init__(self):
        super().__init__()
        self.streams = []

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            kept = _Kept(stream)
            self.streams.append(kept)
            yield kept


class _Kept(KeepsWriteError):
    """A DCP stream that keeps its first OSError; everything else is the stream's."""

    def __getattr__(self, name):
        return getattr(self.file, name)


def _dcp_save(state: dict, root: str, staging: str, group) -> None:
    """dcp.save into `staging`; a full disk on this rank (however DCP reports it) becomes
    io.no_space's line, other DCP failures one line naming the rank and the error."""
    writer = FileSystemWriter(staging, sync_files=True, single_file_per_rank=True)
    writer.fs = _KeepingFileSystem()
    try:
        dcp.save(state, storage_writer=writer, planner=DefaultSavePlanner(), process_group=group,
                 no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as err:  # DCP's is a BaseException
        errors = [s.error for s in writer.fs.streams if s.error is not None]
        failures = getattr(err, "failures", {}) or {}
        errors += [failure[0] for failure in failures.values()]
        if any(getattr(e, "errno", None) == errno.ENOSPC for e in errors):
            what = f"{os.path.basename(staging)} (rank {collectives.rank()}'s torch_dist files)"
            raise io.no_space(root, _local_bytes(state), what, "the staging directory was "
                              "removed", freed=_tree_bytes(staging)) from None
        first = errors[0] if failures or errors else err
        raise CheckpointError(f"torch.distributed.checkpoint could not write {staging}: "
                              f"{type(first).__name__}: {str(first).strip().splitlines()[0]}"
                              ) from None


def _local_bytes(state: dict) -> int:
    """The bytes of this rank's chunks in `state` (what its .distcp files hold)."""
    total = 0
    for value in state.values():
        shards = value.local_shards() if hasattr(value, "local_shards") else [value]
        total += sum(s.tensor.nbytes if hasattr(s, "tensor") else getattr(s, "nbytes", 0)
                     for s in shards)
    return total


def _tree_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(directory)
               for n in names if os.path.isfile(os.path.join(d, n)))


def _publish(root: str, staging: str, final: str) -> None:
    """Rename the complete staging directory to its final name (replacing an older save
    of the same iteration only after the new one is complete)."""
    old = None
    if os.path.exists(final):
        old = final + ".old.tmp"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    publish(staging, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_common(directory: str, verify: bool) -> dict:
    common = io.load_file(os.path.join(directory, COMMON), verify,
                          foreign=lambda state: not written_here(state))
    if not isinstance(common, dict):
        raise CheckpointError(f"{directory}/{COMMON} holds a {type(common).__name__}, not a "
                              f"dict")
    return common


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
