"""--ckpt-format torch_dist: Megatron-Core's checkpoint format, through torch.distributed.checkpoint.

    <root>/latest_checkpointed_iteration.txt
    <root>/iter_0000100/.metadata, __R_K.distcp   DCP's metadata and each rank's chunks
    <root>/iter_0000100/common.pt           iteration, config, lr schedule, optimizer step and
                                            hyper-parameters, every rank's RNG state
    <root>/iter_0000100/metadata.json       {"sharded_backend": "torch_dist", ...}
    <root>/iter_0000100/checksums.sha256    sha256sum of every file above (sha256sum -c)

Every rank writes only its own chunks, with global offsets from the sharding metadata, under
Megatron-Core's keys (mcore_keys.py, dist_state.py); replicas (DP, replicated parameters) are
written once. Persistent buffers are saved as the parameters are (the routers' expert bias:
Megatron-Core's `decoder.layers.mlp.router.expert_bias`, [L, E]); one that a checkpoint lacks
(saved before they were) keeps its initial value, with a notice. At load every rank asks for the chunks of the layout it runs, whatever the saved
TP / PP / DP / virtual-PP layout was, and reads only those: weights and optimizer state
(fp32 main parameters, both Adam moments, distributed-optimizer pieces) re-shard alike. The
RNG state is restored when the layout is unchanged. How the directory's files are read,
checked and published safely: dist_io.py.
"""
import os
from dataclasses import fields
from typing import Any, Dict, Optional

import torch

from megatron.checkpointing import collectives, dist_io, dist_state
from megatron.checkpointing.dist_io import SafeReader, check_keys, load_sharded, read_common
from megatron.checkpointing.dist_regions import placement
from megatron.checkpointing.formats import Counters, Flat, Found, RunState, Target
from megatron.checkpointing.io import CheckpointError
from megatron.checkpointing.mcore_keys import mcore_key
from megatron.checkpointing.megatron_legacy import stored_config_from_args
from megatron.checkpointing.finite import check_finite_optimizer, finite_model_state
from megatron.checkpointing.reshard import EVEN_SPLIT, WORD
from megatron.checkpointing.rng import rng_state, set_rng_state
from megatron.checkpointing.tracker import CHECKPOINT_VERSION, iteration_dir
from megatron.config import ModelConfig
from megatron.model import GPTModel


class TorchDistFormat:
    """Megatron-Core's distributed checkpoint (see the module docstring)."""

    name = "torch_dist"
    ckpt_format = "torch_dist"
    reshards_on_load = True
    naming: dist_state.Naming = staticmethod(dist_state.sharded_key)
    """How the model's tensors are keyed (and, through them, the optimizer's)."""
    prefix = ""
    """Put before every model tensor's key (not the optimizer's)."""

    def detect(self, directory: str) -> bool:
        return dist_io.is_torch_dist(directory)

    def stored_state(self, found: Found) -> Dict[str, Any]:
        path = os.path.join(found.directory, dist_io.COMMON)
        common = read_common(found.directory, verify=False) if os.path.isfile(path) else {}
        return dict(common, config=stored_config(common))

    def read_common(self, found: Found, verify: bool) -> dict:
        """The state that is not sharded, checked as every load checks it (verified_common)."""
        return verified_common(found, verify)

    def write_files(self, root: str, iteration: Optional[int], state: dict, common: dict,
                    final: Optional[str] = None) -> None:
        """Collective: the iteration's files (dist_io.write_iteration)."""
        dist_io.write_iteration(root, iteration, state, common, final=final)

    def snapshot(self, root: str, iteration: int, run: RunState) -> dict:
        """(sharded state: views of the live tensors, common state) of this rank. Collective
        (the RNG states go to rank 0)."""
        dist_io.prepare_iteration(root)
        collectives.barrier()
        with_optimizer = not run.config.checkpoint.no_save_optim and run.optimizer is not None
        state, _ = sharded_state(run, saving=True, with_optimizer=with_optimizer, fmt=self)
        rng = None if run.config.checkpoint.no_save_rng else _rng_states(run.pstate)
        return {"state": state, "common": common_state(iteration, run, with_optimizer, rng)}

    def write(self, root: str, iteration: int, snapshot: dict) -> None:
        self.write_files(root, iteration, snapshot["state"], snapshot["common"])

    def load(self, found: Found, run: RunState) -> Counters:
        return _load(found, run, self)

    def read_model(self, found: Found):
        common = self.read_common(found, verify=True)
        metadata = SafeReader(found.directory).read_metadata()
        config = stored_config(common) or _given_config(found, metadata, self)
        full: Flat = {}
        entries, model = _full_entries(_model_config(config), full, self.naming)
        state = weights_to_read(entries, found.directory, metadata, 0, 1, self)
        load_sharded(found.directory, state)
        finite_model_state(full, found.root)
        stored = dict(common, config=config, release=found.release,
                      sharding=model.sharding_metadata())
        stored.setdefault("iteration", found.iteration)
        return full, stored

    def write_model(self, save: str, full: Flat, stored: Dict[str, Any], target: Target) -> str:
        if target.ep != 1 or target.etp is not None:
            flag = ("--target-expert-model-parallel-size" if target.ep != 1
                    else "--target-expert-tensor-parallel-size")
            raise CheckpointError(f"{flag} applies to the torch format only (torch_dist "
                                  f"re-shards experts at load); drop it")
        iteration = int(stored.get("iteration", 0))
        if os.path.exists(iteration_dir(save, iteration)):
            raise CheckpointError(f"{iteration_dir(save, iteration)} already exists; choose "
                                  f"another --save directory or remove it")
        config = dict(stored.get("config") or {})
        entries, model = _full_entries(_model_config(config), dict(full), self.naming)
        missing = sorted(set(model.checkpoint_tensors()) - set(full))
        if missing:
            raise CheckpointError(f"the checkpoint lacks {missing[0]} of the model of its config")
        parallel = dict(config.get("parallel", {}), tensor_model_parallel_size=1,
                        pipeline_model_parallel_size=1, **EVEN_SPLIT)
        common = {"iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION,
                  "config": dict(config, parallel=parallel),
                  "consumed_train_samples": stored.get("consumed_train_samples", 0),
                  "consumed_valid_samples": stored.get("consumed_valid_samples", 0)}
        state = dist_state.model_state(entries, 0, 1, saving=True, prefix=self.prefix)
        dist_io.prepare_iteration(save)
        self.write_files(save, iteration, state, common)
        return iteration_dir(save, iteration)


FORMAT = TorchDistFormat()


# -- save ---------------------------------------------------------------------------
def _rng_states(pstate) -> Optional[dict]:
    mine = (_rank_key(pstate), rng_state())
    gathered = collectives.gather(mine)
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


def sharded_state(run: RunState, saving: bool, with_optimizer: bool, fmt=FORMAT):
    """({key: ShardedTensor}, the optimizer tensors or None) of this rank, keyed as `fmt`
    (a TorchDistFormat) keys them."""
    entries = dist_state.model_entries(run.models, run.pstate, run.config.model.num_layers,
                                       fmt.naming)
    rank, world = collectives.rank(), collectives.world()
    state = dist_state.model_state(entries, rank, world, saving, fmt.prefix)
    tensors = None
    if with_optimizer:
        moments = dist_state.moment_names(run.optimizer)
        tensors = dist_state.OptimizerTensors(run.optimizer, entries, moments, fresh=not saving)
        state.update(tensors.state(rank, world, saving))
    return state, tensors


def common_state(iteration: int, run: RunState, with_optimizer: bool,
                 rng: Optional[dict]) -> dict:
    common = {"iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION,
              "config": run.config.to_dict(), "consumed_train_samples": run.consumed_train,
              "consumed_valid_samples": run.consumed_valid,
              "parallel": _layout(run.pstate, len(run.models))}
    if with_optimizer:
        common["optimizer"] = dist_state.optimizer_common(
            run.optimizer, dist_state.moment_names(run.optimizer))
        common["opt_param_scheduler"] = run.scheduler.state_dict()
    if rng is not None:
        common["rng_state"] = rng
    return common


# -- load ---------------------------------------------------------------------------
def _load(found: Found, run: RunState, fmt) -> Counters:
    ckpt, directory = run.config.checkpoint, found.directory
    common = fmt.read_common(found, ckpt.verify_checkpoint)
    ours = "consumed_train_samples" in common
    saved_optim = common.get("optimizer")
    with_optimizer = (ours and not ckpt.no_load_optim and not ckpt.finetune and not found.release
                      and run.optimizer is not None)
    if with_optimizer and saved_optim is None:
        raise CheckpointError(f"{found.root} has no optimizer state (saved with --no-save-optim); "
                              f"load it with --no-load-optim or --finetune")
    tensors, have_fp32 = _fill(found, run, saved_optim if with_optimizer else None, fmt)
    if run.optimizer is not None:
        run.optimizer.reload_model_params()
    if not ours:
        if run.pstate.rank == 0:
            print(f" > loaded the weights of the {fmt.name} checkpoint {directory} (no state "
                  f"of this framework: optimizer, schedule and counters start fresh)", flush=True)
        return 0, 0, 0
    if run.optimizer is None:  # inference: the weights only
        return int(common["iteration"]), 0, 0
    if ckpt.finetune or found.release:
        return 0, 0, 0
    if with_optimizer:
        load = (dist_state.load_distributed if run.optimizer.is_distributed
                else dist_state.load_regular)
        load(run.optimizer, tensors, saved_optim, have_fp32)
        check_finite_optimizer(run.optimizer, run.models, found.root)
        run.scheduler.load_state_dict(common["opt_param_scheduler"])
    _restore_rng(common, run)
    return (int(common["iteration"]), int(common.get("consumed_train_samples", 0)),
            int(common.get("consumed_valid_samples", 0)))


def verified_common(found: Found, verify: bool) -> dict:
    """The iteration's common.pt ({} when it has none), checked as every load checks it:
    with `verify` the manifest and the file's digest (Megatron-Core's carry neither and are
    read unverified, see dist_io.written_here), and always its iteration. Collective."""
    path = os.path.join(found.directory, dist_io.COMMON)
    common = read_common(found.directory, verify) if os.path.isfile(path) else {}
    if verify:
        dist_io.verify_checksums(found.directory, required=dist_io.written_here(common))
    found.check_iteration(common.get("iteration"), path)
    return common


def _fill(found: Found, run: RunState, saved_optim: Optional[dict], fmt):
    """Read this rank's weights into the models, and with `saved_optim` the saved optimizer
    tensors: (those tensors, not yet given to the optimizer, whether they include the fp32
    main parameters); (None, False) without."""
    directory, tensors, have_fp32 = found.directory, None, False
    entries = dist_state.model_entries(run.models, run.pstate, run.config.model.num_layers,
                                       fmt.naming)
    metadata = SafeReader(directory).read_metadata()
    state = weights_to_read(entries, directory, metadata, collectives.rank(), collectives.world(),
                            fmt)
    if saved_optim is not None:  # the moments saved, not those of this fresh optimizer
        tensors = dist_state.OptimizerTensors(run.optimizer, entries, saved_optim["moments"],
                                              fresh=True)
        optim_state = tensors.state(collectives.rank(), collectives.world(), saving=False)
        fp32 = {k: v for k, v in optim_state.items() if f".{dist_state.FP32}." in k}
        have_fp32 = bool(fp32) and all(k in metadata.state_dict_metadata for k in fp32)
        if not have_fp32:
            optim_state = {k: v for k, v in optim_state.items() if k not in fp32}
        check_keys(optim_state, metadata, directory, "optimizer state")
        state.update(optim_state)
    with torch.no_grad():
        load_sharded(directory, state)
    return tensors, have_fp32


def _restore_rng(common: dict, run: RunState) -> None:
    states, pstate = common.get("rng_state"), run.pstate
    if run.config.checkpoint.no_load_rng or not states:
        return
    if common.get("parallel") == _layout(pstate, len(run.models)) and _rank_key(pstate) in states:
        set_rng_state(states[_rank_key(pstate)])
    elif pstate.rank == 0:
        print(" > torch_dist: the checkpoint was saved at another layout; the RNG state "
              "starts from the seed", flush=True)


def weights_to_read(entries, directory: str, saved, rank: int, world: int,
                    fmt=FORMAT) -> dict:
    """{key: ShardedTensor} of the weights and buffers of `entries` to read from `directory`,
    checked against its DCP metadata `saved`. A persistent buffer it lacks (saved before
    buffers were saved, or by a model without them) keeps the value it has, with a notice."""
    state = dist_state.model_state(entries, rank, world, saving=False, prefix=fmt.prefix)
    absent = [k for k in dist_state.buffer_keys(entries, fmt.prefix)
              if k not in saved.state_dict_metadata]
    if absent and rank == 0:
        print(f" > {fmt.name}: {directory} holds no {', '.join(absent)} (a buffer, such as the "
              f"expert bias, that older checkpoints lack): it keeps its initial value",
              flush=True)
    state = {k: v for k, v in state.items() if k not in absent}
    check_keys(state, saved, directory, "a model weight")
    return state


# -- the weights alone, and whole models ---------------------------------------------
def load_model_weights(directory: str, models, num_layers: int, pstate, fmt=FORMAT) -> None:
    """Only the weights of a torch_dist iteration directory (ours or Megatron-Core's; of
    `fmt`'s keys), at this run's layout: collective over all ranks."""
    with collectives.process_group():
        entries = dist_state.model_entries(models, pstate, num_layers, fmt.naming)
        state = weights_to_read(entries, directory, SafeReader(directory).read_metadata(),
                                collectives.rank(), collectives.world(), fmt)
        with torch.no_grad():
            load_sharded(directory, state)


def save_model_weights(directory: str, models, num_layers: int, pstate, fmt=FORMAT) -> None:
    """Only the weights, as a torch_dist (or `fmt`) iteration directory (no tracker, no
    common state beyond the format's metadata): collective over all ranks."""
    with collectives.process_group():
        entries = dist_state.model_entries(models, pstate, num_layers, fmt.naming)
        state = dist_state.model_state(entries, collectives.rank(), collectives.world(),
                                       saving=True, prefix=fmt.prefix)
        root, name = os.path.split(os.path.abspath(directory))
        dist_io.prepare_iteration(root)
        collectives.barrier()
        fmt.write_files(root, None, state, {}, final=name)


def stored_config(common: dict) -> dict:
    """Our config dict of a torch_dist checkpoint (from Megatron-LM's args for theirs; {}
    when it has neither)."""
    if common.get("config"):
        return common["config"]
    if common.get("args") is not None:
        return stored_config_from_args(common["args"])
    return {}


def _given_config(found: Found, metadata, fmt) -> dict:
    """The configuration of a checkpoint that stores none: the caller's model flags
    (Found.model), the vocabulary's rows read from the embedding's shape."""
    if not found.model:
        raise CheckpointError(f"{found.directory} stores no model configuration (no config or "
                              f"args in {dist_io.COMMON}); pass its model flags (--num-layers, "
                              f"--hidden-size, --num-attention-heads, --max-position-embeddings, "
                              f"...) as to Megatron-LM's tools")
    model = dict(found.model)
    embedding = metadata.state_dict_metadata.get(fmt.prefix + mcore_key(WORD)[0])
    if not model.get("padded_vocab_size") and embedding is not None:
        model["padded_vocab_size"] = int(embedding.size[0])
    return {"model": model}


def _model_config(config: dict) -> ModelConfig:
    known = {f.name for f in fields(ModelConfig)}
    model = {k: v for k, v in (config.get("model") or {}).items() if k in known}
    if not model.get("padded_vocab_size"):
        raise CheckpointError("the stored configuration has no padded_vocab_size")
    return ModelConfig(**model)


def _full_entries(cfg: ModelConfig, full: Flat, naming: dist_state.Naming):
    """Entries over the full tensors `full` of every checkpoint tensor, keyed by `naming`
    (those it lacks added as zeros: the initial value of the buffers)."""
    model = GPTModel(cfg, device="meta")
    meta = model.sharding_metadata()
    entries = []
    for name, tensor in model.checkpoint_tensors().items():
        if name not in full:
            full[name] = torch.zeros(tensor.shape, dtype=torch.float32)
        key, layer = naming(name, cfg)
        entries.append(dist_state.Entry(full[name], placement(
            key, layer, cfg.num_layers, tuple(tensor.shape), meta[name], 0, 1), False,
            not isinstance(tensor, torch.nn.Parameter)))
    return entries, model
