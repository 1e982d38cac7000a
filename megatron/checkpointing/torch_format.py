"""--ckpt-format torch: one file per model-parallel rank, in Megatron-LM's layout.

    <root>/latest_checkpointed_iteration.txt
    <root>/iter_0000100/mp_rank_00/model_optim_rng.pt        (PP = 1)
    <root>/iter_0000100/mp_rank_00_001/model_optim_rng.pt    (PP > 1: TP rank, PP rank)

Each file holds the model (Megatron's nested key layout; `model0`, `model1`... for virtual
pipeline chunks), optimizer, lr scheduler, RNG states, iteration, consumed samples, the
config as a plain dict and each parameter's sharding metadata. Files are written durably
(io.py); the tracker is updated last, so an interrupted save leaves the previous checkpoint
intact. Loading uses `torch.load(weights_only=True)`: a checkpoint cannot run code.

Each file also carries what Megatron-LM's and Megatron-DeepSpeed's loaders read (`args`,
`checkpoint_version`, `lr_scheduler`, Megatron's `rng_state` list; megatron_legacy.py), so
Megatron resumes our checkpoints; theirs are the Megatron-LM format (megatron_lm.py).

With the distributed optimizer the model file says `"distributed_optimizer": True` and has
no "optimizer" entry; every DP x CP rank writes its shard next to it:

    <root>/iter_0000100/mp_rank_00/distrib_optim_dp_001.pt

Such a checkpoint resumes with the same data-parallel size, or with another one or without
--use-distributed-optimizer (the shards are then merged on load). A regular optimizer state
also loads into the distributed optimizer (each rank takes its shard of it).
"""
import os
from typing import Any, Dict, Optional

from megatron.checkpointing import collectives, io, megatron_legacy, reshard
from megatron.checkpointing.formats import Counters, Found, RunState, Target
from megatron.checkpointing.io import CheckpointError
from megatron.checkpointing.finite import check_finite_optimizer, finite_model_state
from megatron.checkpointing.model_file import (check_layout, first_rank_file, is_chunk_key,
                                               load_into_models,
                                               model_key, rank_file, read_model_file, shard_files,
                                               shard_path, sharding_of, tokenizer_file_digests,
                                               to_megatron_layout)
from megatron.checkpointing.rng import current_device_states, rng_state, set_rng_state
from megatron.checkpointing.tracker import (CHECKPOINT_VERSION, iteration_dir,
                                           write_tracker)
from megatron.optimizer.distributed import merge_optimizer_shards

_TENSOR_ENTRIES = ("optimizer",)


class TorchFormat:
    """Our per-rank files (see the module docstring)."""

    name = "torch"
    ckpt_format = "torch"
    reshards_on_load = False

    def detect(self, directory: str) -> bool:
        return first_rank_file(directory) is not None

    def stored_state(self, found: Found) -> Dict[str, Any]:
        path = first_rank_file(found.directory)
        if path is None:
            raise CheckpointError(f"no mp_rank_*/model_optim_rng.pt in {found.directory}; the "
                                  f"checkpoint is incomplete")
        return stored_entries(read_model_file(path, verify=False, mmap=True))

    # -- save -------------------------------------------------------------------------
    def snapshot(self, root: str, iteration: int, run: RunState) -> dict:
        pstate = run.pstate
        if pstate.rank == 0:
            io.remove_stale_temp_files(root)
        collectives.barrier()
        sharded = _saves_optimizer(run) and run.optimizer.is_distributed
        shard_rank, shard_size = pstate.dp_cp_rank, pstate.dp_cp_size
        files, stale = [], None
        # One model file per (TP, PP, EP) rank that some rank holds, written by the lowest
        # such rank (expert-DP rank 0 when expert TP is TP; expert-DP spans DP x CP). Each
        # holds the TP rank's dense shard and the EP rank's experts at expert-TP rank
        # TP rank mod ETP. The distributed optimizer's shards are per DP x CP rank.
        directory = iteration_dir(root, iteration)
        if _writes_model_file(pstate):
            path = rank_file(directory, pstate.tp_rank, pstate.pp_rank, pstate.pp_size,
                             _ep_rank(pstate))
            files.append((path, model_state(iteration, run)))
            if sharded and shard_rank == 0:
                stale = (os.path.dirname(path), shard_size)
        if sharded:
            files.append((shard_path(directory, pstate.tp_rank, pstate.pp_rank, pstate.pp_size,
                                     shard_rank), run.optimizer.state_dict()))
        return {"files": files, "stale_shards": stale, "tracker": pstate.rank == 0}

    def write(self, root: str, iteration: int, snapshot: dict) -> None:
        what = f"saving iteration {iteration} to {root}"
        with collectives.agreed(what):  # a failure anywhere (a full disk) stops every rank
            for path, obj in snapshot["files"]:
                io.save_file(obj, path)
            if snapshot["stale_shards"] is not None:
                directory, size = snapshot["stale_shards"]
                for stale in shard_files(directory, from_rank=size):
                    os.remove(stale)  # shards of a larger DP size saved here before
        with collectives.agreed(what):
            if snapshot["tracker"]:
                write_tracker(root, iteration)

    # -- load -------------------------------------------------------------------------
    def load(self, found: Found, run: RunState) -> Counters:
        ckpt, pstate = run.config.checkpoint, run.pstate
        state = read_rank_file(found, pstate, ckpt.verify_checkpoint)
        check_layout(state, pstate, len(run.models), found.root, run.pipeline_split())
        load_into_models(state, run.models, found.root)
        if run.optimizer is None:  # inference: the weights only
            return stored_counters(state)
        run.optimizer.reload_model_params()  # fp32 main copies follow; a saved state overrides
        if ckpt.finetune or found.release:
            return 0, 0, 0
        if not ckpt.no_load_optim:
            _load_optimizer(found, state, run)
            run.scheduler.load_state_dict(state["opt_param_scheduler"])
        if not ckpt.no_load_rng and "rng_state" in state:
            entry = state["rng_state"]
            entry = entry[0] if isinstance(entry, list) else entry
            set_rng_state(megatron_legacy.rng_entry_to_ours(entry, *current_device_states()))
        return stored_counters(state)

    # -- whole models, for the tools ---------------------------------------------------
    def read_model(self, found: Found):
        source = reshard.read_source(found)  # every file checksum-verified
        for state in source.states.values():
            found.check_iteration(state.get("iteration"), found.directory)
        full = finite_model_state(reshard.full_model(source), found.root)
        stored = dict(stored_entries(source.states[min(source.states)]), release=found.release,
                      sharding=source.sharding.to_dict(full))
        stored.setdefault("iteration", found.iteration)
        return full, stored

    def write_model(self, save: str, full, stored: Dict[str, Any], target: Target) -> str:
        return reshard.write_sharded(save, full, stored, target)


FORMAT = TorchFormat()


def stored_entries(state: dict) -> Dict[str, Any]:
    """A rank file's state without its tensors; `config` is {} when it stores none (a
    Megatron-LM file's is derived from its args)."""
    out = {k: v for k, v in state.items()
           if k not in _TENSOR_ENTRIES and k != "model" and not is_chunk_key(k)}
    out["config"] = state.get("config") or state.get("megatron_config") or {}
    return out


def stored_counters(state: dict) -> Counters:
    return (int(state.get("iteration", 0)), int(state.get("consumed_train_samples", 0)),
            int(state.get("consumed_valid_samples", 0)))


def model_state(iteration: int, run: RunState) -> dict:
    """This rank's model file: weights, counters, config, layout, optimizer, RNG."""
    config, pstate, models, ckpt = run.config, run.pstate, run.models, run.config.checkpoint
    state = {"iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION,
             "config": config.to_dict(), "consumed_train_samples": run.consumed_train,
             "consumed_valid_samples": run.consumed_valid, "parallel": saved_layout(run)}
    for i, model in enumerate(models):
        state[model_key(i, len(models))] = to_megatron_layout(model.state_dict())
    state["sharding"] = sharding_of(models)
    state["tokenizer_files"] = tokenizer_file_digests(config.data)
    if _saves_optimizer(run):
        if run.optimizer.is_distributed:
            state["distributed_optimizer"] = True
        else:
            state["optimizer"] = run.optimizer.state_dict()
        state["opt_param_scheduler"] = run.scheduler.state_dict()
    if not ckpt.no_save_rng:
        state["rng_state"] = rng_state()
    megatron_legacy.add_megatron_entries(state, config, pstate, run.optimizer)
    return state


def saved_layout(run: RunState) -> dict:
    pstate = run.pstate
    layout = {"tensor_model_parallel_size": pstate.tp_size,
              "pipeline_model_parallel_size": pstate.pp_size,
              "virtual_pipeline_model_parallel_size": len(run.models)}
    if run.pipeline_split() is not None:
        layout["pipeline_layout"] = run.pipeline_split()
    if pstate.ep_size > 1:
        layout["expert_model_parallel_size"] = pstate.ep_size
    if pstate.etp_size != pstate.tp_size:
        layout["expert_tensor_parallel_size"] = pstate.etp_size
    return layout


def _saves_optimizer(run: RunState) -> bool:
    return not run.config.checkpoint.no_save_optim and run.optimizer is not None


def _ep_rank(pstate) -> Optional[int]:
    """This rank's EP rank in checkpoint paths; None without expert parallelism."""
    return pstate.ep_rank if pstate.ep_size > 1 else None


def _writes_model_file(pstate) -> bool:
    if pstate.etp_size == pstate.tp_size:
        return pstate.edp_rank == 0
    return pstate.dims.first_of_cell(pstate.rank)


def _layout_hint(found: Found) -> str:
    listed = sorted(os.listdir(found.directory)) if os.path.isdir(found.directory) else []
    return (f"found {listed or 'nothing'} in {found.directory}; the checkpoint was saved with "
            f"another tensor/pipeline layout: load it with the same --tensor-model-parallel-size "
            f"and --pipeline-model-parallel-size, add --universal-checkpoint, or re-shard it "
            f"with tools/merge_mp_partitions.py")


def read_rank_file(found: Found, pstate, verify: bool = True) -> dict:
    """This rank's file of the iteration `found`, checked against the tracker."""
    path = rank_file(found.directory, pstate.tp_rank, pstate.pp_rank, pstate.pp_size,
                     _ep_rank(pstate))
    if not os.path.isfile(path):
        raise CheckpointError(f"missing {path}: {_layout_hint(found)}")
    state = read_model_file(path, verify)
    found.check_iteration(state.get("iteration"), path)
    return state


# -- optimizer state ----------------------------------------------------------------------
def _load_optimizer(found: Found, state: dict, run: RunState) -> None:
    """Load the regular or sharded optimizer state into either kind of optimizer."""
    optimizer, pstate = run.optimizer, run.pstate
    if state.get("distributed_optimizer"):
        saved = None
        if optimizer.is_distributed and _saved_dp_size(found, pstate) == pstate.dp_cp_size:
            saved = _load_shard(found, pstate)
        if saved is None or not optimizer.fits_shard(saved):
            # a regular optimizer, another DP size or --ddp-bucket-size: merge the shards
            # (load_state_dict then cuts out this rank's pieces)
            saved = consolidate_distributed_optimizer(_rank_dir(found, pstate))
    elif "optimizer" in state:
        saved = megatron_legacy.optimizer_to_ours(state["optimizer"], run.models)
    else:
        raise CheckpointError(f"{found.root} has no optimizer state (saved with --no-save-optim); "
                              f"load it with --no-load-optim or --finetune")
    try:
        optimizer.load_state_dict(saved)
    except (ValueError, KeyError, IndexError) as err:
        raise CheckpointError(f"optimizer state in {found.root} does not fit this run: "
                              f"{str(err).splitlines()[0]}") from err
    check_finite_optimizer(optimizer, run.models, found.root)


def _rank_dir(found: Found, pstate) -> str:
    """This rank's (TP, PP) directory, where the distributed optimizer's shards are."""
    return os.path.dirname(rank_file(found.directory, pstate.tp_rank, pstate.pp_rank,
                                     pstate.pp_size))


def _saved_dp_size(found: Found, pstate) -> int:
    return len(shard_files(_rank_dir(found, pstate)))


def _load_shard(found: Found, pstate) -> dict:
    """This DP x CP rank's distributed-optimizer shard (saved with this run's DP x CP size)."""
    rank, size = pstate.dp_cp_rank, pstate.dp_cp_size
    path = shard_path(found.directory, pstate.tp_rank, pstate.pp_rank, pstate.pp_size, rank)
    shard = io.load_file(path)
    if shard.get("dp_size") != size:
        raise CheckpointError(f"{path} was saved with {shard.get('dp_size')} data-parallel ranks, "
                              f"this run has {size}; its shard files are inconsistent")
    return shard


def consolidate_distributed_optimizer(directory: str) -> dict:
    """The regular (MegatronOptimizer) optimizer state of one model-parallel rank directory,
    merged from the distributed-optimizer shards of all its DP ranks: what
    `state["optimizer"]` of a checkpoint saved without --use-distributed-optimizer holds."""
    files = shard_files(directory) if os.path.isdir(directory) else []
    if not files:
        raise CheckpointError(f"no distributed-optimizer shards (distrib_optim_dp_*.pt) in "
                              f"{directory}; was it saved with --use-distributed-optimizer?")
    shards = [io.load_file(f) for f in files]
    sizes = {s["dp_size"] for s in shards}
    ranks = sorted(s["dp_rank"] for s in shards)
    if sizes != {len(shards)} or ranks != list(range(len(shards))):
        raise CheckpointError(f"{directory} holds shards of data-parallel ranks {ranks} saved "
                              f"with sizes {sorted(sizes)}: incomplete; save it again")
    return merge_optimizer_shards(shards)

