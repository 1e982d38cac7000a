"""Checkpoints in Megatron-LM's layout.

    <root>/latest_checkpointed_iteration.txt
    <root>/iter_0000100/mp_rank_00/model_optim_rng.pt        (PP = 1)
    <root>/iter_0000100/mp_rank_00_001/model_optim_rng.pt    (PP > 1: TP rank, PP rank)

Each file holds the model (Megatron's nested key layout; `model0`, `model1`...
for virtual pipeline chunks), optimizer, lr scheduler, RNG states, iteration,
consumed samples and the config as a plain dict. Files are written under a
temporary name and renamed; the tracker file is updated last, so an
interrupted save leaves the previous checkpoint intact. Loading uses
`torch.load(weights_only=True)`: a checkpoint cannot run code.

Each file also carries what Megatron-LM's and Megatron-DeepSpeed's loaders read (`args`,
`checkpoint_version`, `lr_scheduler`, Megatron's `rng_state` list), and Megatron's own files
load here (see megatron_legacy.py); --universal-checkpoint re-shards another layout (universal.py).

With the distributed optimizer the model file says `"distributed_optimizer": True`
and has no "optimizer" entry; every DP rank writes its shard next to it:

    <root>/iter_0000100/mp_rank_00/distrib_optim_dp_001.pt

Such a checkpoint resumes with the same data-parallel size, or without
--use-distributed-optimizer (the shards are then consolidated on load, see
`consolidate_distributed_optimizer`). A regular optimizer state also loads
into the distributed optimizer (each rank takes its shard of it).
"""
import functools
import os
import random
import re
from typing import Dict, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.optimizer.distributed import merge_optimizer_shards
from megatron.checkpointing import io as checkpoint_io
from megatron.checkpointing.io import CheckpointError  # noqa: F401 (re-exported)
from megatron.checkpointing import megatron_legacy
from megatron.mpu.random import get_device_rng_state, get_rng_tracker, set_device_rng_state

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0
TOKENIZER_FILE_FIELDS = ("vocab_file", "merge_file", "tokenizer_model")


def checkpoint_path(root: str, iteration: int, tp_rank: int, pp_rank: int, pp_size: int,
                    release: bool = False, ep_rank: Optional[int] = None) -> str:
    """`ep_rank`: with expert parallelism (EP > 1) each EP rank has its own folder,
    Megatron-LM's mp_rank_TT[_PPP]_EEE."""
    directory = "release" if release else f"iter_{iteration:07d}"
    rank_dir = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    if ep_rank is not None:
        rank_dir += f"_{ep_rank:03d}"
    return os.path.join(root, directory, rank_dir, "model_optim_rng.pt")


def distributed_optimizer_path(root: str, iteration: int, tp_rank: int, pp_rank: int,
                               pp_size: int, dp_rank: int) -> str:
    directory = os.path.dirname(checkpoint_path(root, iteration, tp_rank, pp_rank, pp_size))
    return os.path.join(directory, f"distrib_optim_dp_{dp_rank:03d}.pt")


_SHARD_FILE = re.compile(r"^distrib_optim_dp_(\d{3,})\.pt$")


def _shard_files(directory: str, from_rank: int = 0) -> list:
    """The distributed-optimizer shard files in one rank directory (DP rank >= `from_rank`)."""
    found = sorted((int(m.group(1)), name) for name in os.listdir(directory)
                   if (m := _SHARD_FILE.match(name)))
    return [os.path.join(directory, name) for rank, name in found if rank >= from_rank]


# -- model state in Megatron's nested layout -----------------------------------
_EMBEDDING = "language_model.embedding."
_ENCODER = "language_model.encoder."
_HEAD = "word_embeddings_for_head."
_OUTPUT = "language_model.output_layer."


def to_megatron_layout(flat: Dict[str, torch.Tensor]) -> dict:
    nested: dict = {}
    for key, value in flat.items():
        if key.startswith(_ENCODER):
            nested.setdefault("language_model", {}).setdefault("encoder", {})[key[len(_ENCODER):]] = value
        elif key.startswith(_EMBEDDING):
            module, name = key[len(_EMBEDDING):].split(".", 1)
            emb = nested.setdefault("language_model", {}).setdefault("embedding", {})
            emb.setdefault(module, {})[name] = value
        elif key.startswith(_OUTPUT):
            nested.setdefault("language_model", {}).setdefault(
                "output_layer", {})[key[len(_OUTPUT):]] = value
        elif key.startswith(_HEAD):
            nested.setdefault("word_embeddings_for_head", {})[key[len(_HEAD):]] = value
        else:
            raise KeyError(f"unexpected model parameter {key!r}")
    return nested


def from_megatron_layout(nested: dict) -> Dict[str, torch.Tensor]:
    flat = {}
    lm = nested.get("language_model", {})
    for key, value in lm.get("encoder", {}).items():
        flat[_ENCODER + key] = value
    for module, params in lm.get("embedding", {}).items():
        for name, value in params.items():
            flat[f"{_EMBEDDING}{module}.{name}"] = value
    for name, value in lm.get("output_layer", {}).items():
        flat[_OUTPUT + name] = value
    for name, value in nested.get("word_embeddings_for_head", {}).items():
        flat[_HEAD + name] = value
    return flat


# -- RNG ---------------------------------------------------------------------
def rng_state() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"random_rng_state": random.getstate(),
            "np_rng_state": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
            "torch_rng_state": torch.get_rng_state(),
            "device_rng_state": get_device_rng_state(),
            "rng_tracker_states": get_rng_tracker().get_states()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["random_rng_state"])
    name, keys, pos, has_gauss, cached = state["np_rng_state"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch_rng_state"])
    set_device_rng_state(state["device_rng_state"])
    get_rng_tracker().set_states(state["rng_tracker_states"])


def _ep_rank(pstate) -> Optional[int]:
    """This rank's EP rank in checkpoint paths; None without expert parallelism."""
    return pstate.ep_rank if getattr(pstate, "ep_size", 1) > 1 else None


def _writes_model_file(pstate) -> bool:
    if pstate.etp_size == pstate.tp_size:
        return getattr(pstate, "edp_rank", pstate.dp_rank) == 0
    return pstate.dims.first_of_cell(pstate.rank)


def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def sharding_of(models) -> Dict[str, dict]:
    """How each parameter of this rank's chunks is split over TP (megatron.mpu.sharding);
    the chunks share parameter names, so one dict serves them all."""
    meta: Dict[str, dict] = {}
    for model in models:
        meta.update(model.sharding_metadata())
    return meta


# -- save / load ---------------------------------------------------------------
def save_checkpoint(root: str, iteration: int, models, optimizer, scheduler, config, pstate,
                    consumed_train: int, consumed_valid: int) -> None:
    """Write this rank's file (DP rank 0 of each model-parallel group) and the tracker."""
    ckpt = config.checkpoint
    if ckpt.ckpt_format == "torch_dist":
        from megatron.checkpointing import torch_dist
        return torch_dist.save_checkpoint(root, iteration, models, optimizer, scheduler, config,
                                          pstate, consumed_train, consumed_valid)
    state = {"iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION,
             "config": config.to_dict(), "consumed_train_samples": consumed_train,
             "consumed_valid_samples": consumed_valid,
             "parallel": {"tensor_model_parallel_size": pstate.tp_size,
                          "pipeline_model_parallel_size": pstate.pp_size,
                          "virtual_pipeline_model_parallel_size": len(models)}}
    if getattr(pstate, "ep_size", 1) > 1:
        state["parallel"]["expert_model_parallel_size"] = pstate.ep_size
    if pstate.etp_size != pstate.tp_size:
        state["parallel"]["expert_tensor_parallel_size"] = pstate.etp_size
    for i, model in enumerate(models):
        state[_model_key(i, len(models))] = to_megatron_layout(model.state_dict())
    state["sharding"] = sharding_of(models)
    state["tokenizer_files"] = tokenizer_file_digests(config.data)
    sharded = not ckpt.no_save_optim and getattr(optimizer, "is_distributed", False)
    if not ckpt.no_save_optim:
        if sharded:
            state["distributed_optimizer"] = True
        else:
            state["optimizer"] = optimizer.state_dict()
        state["opt_param_scheduler"] = scheduler.state_dict()
    if not ckpt.no_save_rng:
        state["rng_state"] = rng_state()
    megatron_legacy.add_megatron_entries(state, config, pstate, optimizer)
    path = checkpoint_path(root, iteration, pstate.tp_rank, pstate.pp_rank, pstate.pp_size,
                           ep_rank=_ep_rank(pstate))
    if pstate.rank == 0:
        checkpoint_io.remove_stale_temp_files(root)
    if dist.is_initialized():
        dist.barrier()
    # One model file per (TP, PP, EP) rank that some rank holds, written by the lowest
    # such rank (expert-DP rank 0 when expert TP is TP; expert-DP spans DP x CP). Each
    # holds the TP rank's dense shard and the EP rank's experts at expert-TP rank
    # TP rank mod ETP. The distributed optimizer's shards are per DP x CP rank.
    shard_rank, shard_size = _shard_rank_size(pstate)
    if _writes_model_file(pstate):
        checkpoint_io.save_file(state, path)
        shard_dir = os.path.dirname(distributed_optimizer_path(
            root, iteration, pstate.tp_rank, pstate.pp_rank, pstate.pp_size, 0))
        if sharded and shard_rank == 0 and os.path.isdir(shard_dir):
            # shards of a larger DP size saved here before would confuse loading
            for stale in _shard_files(shard_dir, from_rank=shard_size):
                os.remove(stale)
    if sharded:
        checkpoint_io.save_file(optimizer.state_dict(), distributed_optimizer_path(
            root, iteration, pstate.tp_rank, pstate.pp_rank, pstate.pp_size, shard_rank))
    if dist.is_initialized():
        dist.barrier()
    if pstate.rank == 0:
        checkpoint_io.write_text(os.path.join(root, TRACKER), str(iteration))
    if dist.is_initialized():
        dist.barrier()


def tokenizer_file_digests(data_config) -> Dict[str, str]:
    """sha256 of each tokenizer file the run was given (--vocab-file, --merge-file,
    --tokenizer-model), by field name: a resumed run must bring the same vocabulary."""
    digests = {}
    for name in TOKENIZER_FILE_FIELDS:
        path = getattr(data_config, name, None)
        if path and os.path.isfile(path):
            digests[name] = _cached_sha256(path, os.stat(path).st_mtime_ns, os.path.getsize(path))
    return digests


@functools.lru_cache(maxsize=16)
def _cached_sha256(path: str, mtime_ns: int, size: int) -> str:
    return checkpoint_io.file_sha256(path)


def read_tracker(root: str):
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


def _layout_hint(root: str, iteration: int, release: bool) -> str:
    directory = os.path.join(root, "release" if release else f"iter_{iteration:07d}")
    found = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    return (f"found {found or 'nothing'} in {directory}; the checkpoint was saved with another "
            f"tensor/pipeline layout: load it with the same --tensor-model-parallel-size and "
            f"--pipeline-model-parallel-size, or re-shard it with tools/merge_mp_partitions.py")


def load_checkpoint_file(root: str, pstate, verify: bool = True) -> Optional[dict]:
    tracked = read_tracker(root)
    if tracked is None:
        return None
    iteration, release = tracked
    path = checkpoint_path(root, iteration, pstate.tp_rank, pstate.pp_rank, pstate.pp_size, release,
                           ep_rank=_ep_rank(pstate))
    if not os.path.isfile(path):
        raise CheckpointError(f"missing {path}: {_layout_hint(root, iteration, release)}")
    state = read_model_file(path, verify)
    stored = state.get("iteration")
    if not release and stored is not None and int(stored) != iteration:
        raise CheckpointError(f"{path} holds iteration {int(stored)} but {TRACKER} says "
                              f"{iteration}: the directory was mixed up; fix the tracker or "
                              f"restore iter_{iteration:07d}")
    state["_release"] = release
    return state


def finite_model_state(flat: Dict[str, torch.Tensor], root: str) -> Dict[str, torch.Tensor]:
    """`flat` itself, once every floating-point tensor in it is finite (else CheckpointError
    naming the first parameter holding nan/inf)."""
    for name, tensor in flat.items():
        if torch.is_tensor(tensor) and tensor.is_floating_point() and \
                not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise CheckpointError(f"checkpoint {root}: parameter {name} holds {bad} nan/inf "
                                  f"values; the run that saved it had diverged: load an earlier "
                                  f"iteration")
    return flat


def read_model_file(path: str, verify: bool = True, mmap: bool = False) -> dict:
    """One model_optim_rng.pt, ours or Megatron's (see megatron_legacy), in our layout;
    checksum-verified unless `verify` is False. Any problem is a one-line CheckpointError."""
    state = checkpoint_io.load_file(path, verify, mmap)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a checkpoint dict")
    if megatron_legacy.is_megatron_file(state):
        return megatron_legacy.to_ours(state)
    return megatron_legacy.drop_megatron_only(state)


def load_checkpoint(root: str, models, optimizer, scheduler, config, pstate):
    """Restore models (and optimizer, scheduler, RNG unless told not to).

    Returns (iteration, consumed_train_samples, consumed_valid_samples); zeros when
    there is no checkpoint, or with --finetune (weights only, counters reset).
    """
    from megatron.checkpointing import torch_dist
    found = torch_dist.torch_dist_iteration(root, config.checkpoint)
    if found is not None:  # any saved layout: re-sharded by torch.distributed.checkpoint
        return torch_dist.load_checkpoint(root, *found, models, optimizer, scheduler, config,
                                          pstate)
    state = None
    if config.checkpoint.universal_checkpoint:
        from megatron.checkpointing.universal import resharded_state
        state = resharded_state(root, pstate, len(models))
    if state is None:
        state = load_checkpoint_file(root, pstate, config.checkpoint.verify_checkpoint)
    if state is None:
        print(f" no checkpoint found at {root}; starting from scratch", flush=True)
        return 0, 0, 0
    check_layout(state, pstate, len(models), root)
    for i, model in enumerate(models):
        try:
            flat = from_megatron_layout(state[_model_key(i, len(models))])
            model.load_state_dict(finite_model_state(flat, root), strict=True)
        except (KeyError, RuntimeError, AttributeError, TypeError) as err:
            first = (str(err).strip().splitlines() or [repr(err)])[0]
            raise CheckpointError(f"checkpoint {root} does not fit the model built from the flags "
                                  f"({first}); check the model flags") from None
    if optimizer is not None:
        optimizer.reload_model_params()  # fp32 main copies follow; a saved state overrides them
    ckpt = config.checkpoint
    if ckpt.finetune or state["_release"]:
        return 0, 0, 0
    if "resharded_from" in state:
        return _resume_resharded(root, state, scheduler, ckpt, pstate)
    if not ckpt.no_load_optim:
        _load_optimizer(root, state, optimizer, pstate, models)
        scheduler.load_state_dict(state["opt_param_scheduler"])
    if not ckpt.no_load_rng and "rng_state" in state:
        entry = state["rng_state"][0] if isinstance(state["rng_state"], list) else state["rng_state"]
        set_rng_state(megatron_legacy.rng_entry_to_ours(entry, get_device_rng_state(),
                                                        get_rng_tracker().get_states()))
    return (int(state["iteration"]), int(state.get("consumed_train_samples", 0)),
            int(state.get("consumed_valid_samples", 0)))


def _resume_resharded(root: str, state: dict, scheduler, ckpt, pstate):
    """Counters and lr schedule of a re-sharded checkpoint; optimizer and RNG start fresh."""
    tp, pp, _ = state["resharded_from"]
    if pstate.rank == 0:
        print(f" > --universal-checkpoint: re-sharded {root} from TP={tp} PP={pp} to "
              f"TP={pstate.tp_size} PP={pstate.pp_size}; the optimizer state starts fresh",
              flush=True)
    if not ckpt.no_load_optim and "opt_param_scheduler" in state:
        scheduler.load_state_dict(state["opt_param_scheduler"])
    return (int(state["iteration"]), int(state.get("consumed_train_samples", 0)),
            int(state.get("consumed_valid_samples", 0)))


def _load_optimizer(root: str, state: dict, optimizer, pstate, models) -> None:
    """Load the regular or sharded optimizer state into either kind of optimizer."""
    iteration = int(state["iteration"])
    if state.get("distributed_optimizer"):
        saved = None
        if getattr(optimizer, "is_distributed", False) and _saved_dp_size(root, iteration, pstate) \
                == _shard_rank_size(pstate)[1]:
            saved = _load_shard(root, iteration, pstate)
        if saved is None or not optimizer.fits_shard(saved):
            # a regular optimizer, another DP size or --ddp-bucket-size: merge the shards
            # (load_state_dict then cuts out this rank's pieces)
            saved = consolidate_distributed_optimizer(root, pstate.tp_rank, pstate.pp_rank,
                                                      pstate.pp_size, iteration)
    elif "optimizer" in state:
        saved = megatron_legacy.optimizer_to_ours(state["optimizer"], models)
    else:
        raise CheckpointError(f"{root} has no optimizer state (saved with --no-save-optim); "
                              f"load it with --no-load-optim or --finetune")
    try:
        optimizer.load_state_dict(saved)
    except (ValueError, KeyError, IndexError) as err:
        raise CheckpointError(f"optimizer state in {root} does not fit this run: "
                              f"{str(err).splitlines()[0]}") from err


def _saved_dp_size(root: str, iteration: int, pstate) -> int:
    path = distributed_optimizer_path(root, iteration, pstate.tp_rank, pstate.pp_rank,
                                      pstate.pp_size, 0)
    return len(_shard_files(os.path.dirname(path)))


def _load_shard(root: str, iteration: int, pstate) -> dict:
    """This DP x CP rank's distributed-optimizer shard (saved with this run's DP x CP size)."""
    rank, size = _shard_rank_size(pstate)
    path = distributed_optimizer_path(root, iteration, pstate.tp_rank, pstate.pp_rank,
                                      pstate.pp_size, rank)
    shard = checkpoint_io.load_file(path)
    if shard.get("dp_size") != size:
        raise CheckpointError(f"{path} was saved with {shard.get('dp_size')} data-parallel ranks, "
                              f"this run has {size}; its shard files are inconsistent")
    return shard


def _shard_rank_size(pstate):
    """This rank's distributed-optimizer shard (rank, count): DP x CP, so that a checkpoint
    saved at CP x DP = N ranks has the N shard files of DP N (it does not depend on CP)."""
    return (getattr(pstate, "dp_cp_rank", pstate.dp_rank),
            getattr(pstate, "dp_cp_size", pstate.dp_size))


def consolidate_distributed_optimizer(root: str, tp_rank: int = 0, pp_rank: int = 0,
                                      pp_size: int = 1, iteration: Optional[int] = None) -> dict:
    """The regular (MegatronOptimizer) optimizer state of one model-parallel rank,
    merged from the distributed-optimizer shards of all its DP ranks.

    `iteration` defaults to the tracker's. The result is what `state["optimizer"]`
    of a checkpoint saved without --use-distributed-optimizer holds.
    """
    if iteration is None:
        tracked = read_tracker(root)
        if tracked is None:
            raise CheckpointError(f"no {TRACKER} in {root}: not a checkpoint directory")
        iteration = tracked[0]
    directory = os.path.dirname(checkpoint_path(root, iteration, tp_rank, pp_rank, pp_size))
    files = _shard_files(directory) if os.path.isdir(directory) else []
    if not files:
        raise CheckpointError(f"no distributed-optimizer shards (distrib_optim_dp_*.pt) in "
                              f"{directory}; was it saved with --use-distributed-optimizer?")
    shards = [checkpoint_io.load_file(f) for f in files]
    sizes = {s["dp_size"] for s in shards}
    ranks = sorted(s["dp_rank"] for s in shards)
    if sizes != {len(shards)} or ranks != list(range(len(shards))):
        raise CheckpointError(f"{directory} holds shards of data-parallel ranks {ranks} saved "
                              f"with sizes {sorted(sizes)}: incomplete; save it again")
    return merge_optimizer_shards(shards)


def check_layout(state: dict, pstate, num_chunks: int, root: str) -> None:
    """Refuse a checkpoint saved with another TP / PP / virtual-PP layout."""
    saved = state.get("parallel", {})
    expected = {"tensor_model_parallel_size": pstate.tp_size,
                "pipeline_model_parallel_size": pstate.pp_size,
                "virtual_pipeline_model_parallel_size": num_chunks,
                "expert_model_parallel_size": getattr(pstate, "ep_size", 1)}
    if "tensor_model_parallel_size" in saved:  # absent: expert TP was TP
        expected["expert_tensor_parallel_size"] = pstate.etp_size
        saved = {"expert_tensor_parallel_size": saved["tensor_model_parallel_size"], **saved}
    for key, value in expected.items():
        if key in saved and saved[key] != value:
            raise CheckpointError(
                f"checkpoint {root} has {key}={saved[key]} but this run has {value}; use the "
                f"saved layout or re-shard with tools/merge_mp_partitions.py")
