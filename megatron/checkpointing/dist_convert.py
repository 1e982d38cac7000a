"""Whole-model access to torch_dist checkpoints, in one process: for the Hugging Face export
and for converting between the torch and torch_dist formats (tools/merge_mp_partitions.py).

`read_full_model` builds the model of the stored config on the meta device, allocates each
full (TP 1) tensor and lets torch.distributed.checkpoint fill it from whatever layout was
saved (ours, or Megatron-Core's with Megatron-LM's `args` in common.pt). `write_full_model`
writes full tensors as a torch_dist iteration (weights, counters and config; no optimizer).
"""
import os
from dataclasses import fields
from typing import Dict, Tuple

import torch

from megatron.checkpointing import dist_state, experts, reshard, torch_dist
from megatron.checkpointing.dist_regions import placement
from megatron.checkpointing.io import CheckpointError
from megatron.checkpointing.layout import CHECKPOINT_VERSION, read_tracker
from megatron.checkpointing.mcore_keys import mcore_key, stacks_layers
from megatron.checkpointing.megatron_legacy import stored_config_from_args
from megatron.config import ModelConfig
from megatron.model import GPTModel


def stored_config(root: str, common: dict) -> dict:
    """Our config dict of a torch_dist checkpoint (from Megatron-LM's args for theirs)."""
    if common.get("config"):
        return common["config"]
    if common.get("args") is not None:
        return stored_config_from_args(common["args"])
    raise CheckpointError(f"{root} stores no model configuration (no config or args in "
                          f"common.pt); it cannot be converted without one")


def _model_config(config: dict) -> ModelConfig:
    known = {f.name for f in fields(ModelConfig)}
    model = {k: v for k, v in (config.get("model") or {}).items() if k in known}
    if not model.get("padded_vocab_size"):
        raise CheckpointError("the stored configuration has no padded_vocab_size")
    return ModelConfig(**model)


def _full_entries(cfg: ModelConfig, full: Dict[str, torch.Tensor]):
    """Entries over the full tensors `full` (filled with empties from the meta model)."""
    model = GPTModel(cfg, device="meta")
    meta = model.sharding_metadata()
    entries = []
    for name, param in model.named_parameters():
        full[name] = torch.empty(param.shape, dtype=torch.float32) if name not in full \
            else full[name]
        key, layer = mcore_key(name, stacks_layers(cfg))
        entries.append(dist_state.Entry(full[name], placement(
            key, layer, cfg.num_layers, tuple(param.shape), meta[name], 0, 1), False))
    return entries, model


def read_full_model(root: str) -> Tuple[Dict[str, torch.Tensor], dict]:
    """(full TP 1 tensors with global layer numbers, stored config dict) of the latest
    torch_dist iteration under `root`."""
    tracked = read_tracker(root)
    if tracked is None:
        raise CheckpointError(f"no checkpoint at {root}: {torch_dist.TRACKER} is missing")
    directory = torch_dist.iteration_dir(root, *tracked)
    common = torch_dist.stored_common(root) or {}
    config = stored_config(root, common)
    full: Dict[str, torch.Tensor] = {}
    entries, _ = _full_entries(_model_config(config), full)
    with torch_dist.process_group():
        state = dist_state.model_state(entries, 0, 1, saving=False)
        torch_dist.check_keys(state, torch_dist.SafeReader(directory).read_metadata(),
                              directory, "a model weight")
        torch_dist.load_sharded(directory, state)
    return full, config


def write_full_model(save: str, full: Dict[str, torch.Tensor], source_state: dict) -> str:
    """Write full tensors (our global names) as a torch_dist checkpoint under `save`."""
    iteration = int(source_state.get("iteration", 0))
    config = dict(source_state.get("config") or {})
    if os.path.exists(torch_dist.iteration_dir(save, iteration)):
        raise CheckpointError(f"{torch_dist.iteration_dir(save, iteration)} already exists; "
                              f"choose another --save directory or remove it")
    entries, model = _full_entries(_model_config(config), dict(full))
    missing = sorted(set(n for n, _ in model.named_parameters()) - set(full))
    if missing:
        raise CheckpointError(f"the checkpoint lacks {missing[0]} of the model of its config")
    parallel = dict(config.get("parallel", {}), tensor_model_parallel_size=1,
                    pipeline_model_parallel_size=1, num_layers_per_virtual_pipeline_stage=None)
    common = {"iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION,
              "config": dict(config, parallel=parallel),
              "consumed_train_samples": source_state.get("consumed_train_samples", 0),
              "consumed_valid_samples": source_state.get("consumed_valid_samples", 0)}
    with torch_dist.process_group():
        state = dist_state.model_state(entries, 0, 1, saving=True)
        torch_dist.prepare_iteration(save)
        torch_dist.write_iteration(save, iteration, state, common)
    return torch_dist.iteration_dir(save, iteration)


def torch_to_torch_dist(load: str, save: str) -> str:
    """A torch-format checkpoint (any TP / PP) as a torch_dist one (weights and counters)."""
    source = reshard.read_source(load)
    full = reshard.resplit(source, 1, 1)[(0, 0)]
    return write_full_model(save, full, source.states[min(source.states)])


def torch_dist_to_torch(load: str, save: str, tp: int, pp: int, ep: int = 1,
                        etp=None) -> str:
    """A torch_dist checkpoint as a torch-format one at TP `tp` x PP `pp` x EP `ep`, expert
    TP `etp` (None: TP) (weights, counters)."""
    etp = tp if etp is None else etp
    reshard.check_expert_tp(etp, tp)
    full, config = read_full_model(load)
    common = torch_dist.stored_common(load) or {}
    tracked = read_tracker(load)
    state = {"model": None, "config": config, "iteration": common.get("iteration", tracked[0]),
             "consumed_train_samples": common.get("consumed_train_samples", 0),
             "consumed_valid_samples": common.get("consumed_valid_samples", 0),
             "sharding": GPTModel(_model_config(config), device="meta").sharding_metadata()}
    source = reshard.Source(tracked[0], tracked[1], 1, 1, {(0, 0): state})
    sharding = source.sharding
    num_layers = _model_config(config).num_layers
    reshard.check_target(full, config, num_layers, tp, pp, sharding)
    shards = reshard.split_for_target(full, num_layers, tp, pp, sharding)
    for flat in shards.values():
        problem = experts.check_split(flat, ep, sharding)
        if problem:
            raise CheckpointError(f"{problem} (--target-expert-model-parallel-size)")
    shards = experts.recut_expert_tp(shards, tp, tp, etp, sharding)
    return reshard.write_checkpoint(save, source, shards, tp, pp, ep, etp)


def convert(load: str, save: str, ckpt_format: str, tp: int, pp: int, ep: int = 1,
            etp=None) -> str:
    """tools/merge_mp_partitions.py: re-shard or convert the latest checkpoint under `load`
    to `ckpt_format` under `save` (torch at TP `tp` x PP `pp` x EP `ep`, expert TP `etp`
    (None: TP); torch_dist has no layout)."""
    is_dist = torch_dist.stored_common(load) is not None
    if ckpt_format == "torch" and not is_dist:
        return reshard.reshard(load, save, tp, pp, ep, etp)
    if (ep != 1 or etp is not None) and ckpt_format == "torch_dist":
        flag = ("--target-expert-model-parallel-size" if ep != 1
                else "--target-expert-tensor-parallel-size")
        raise CheckpointError(f"{flag} applies to the torch format only (torch_dist re-shards "
                              f"experts at load); drop it")
    if os.path.realpath(load) == os.path.realpath(save):
        raise CheckpointError(f"--save {save} is the --load directory; write the converted "
                              f"checkpoint elsewhere (the input is never modified)")
    if ckpt_format == "torch":
        return torch_dist_to_torch(load, save, tp, pp, ep, etp)
    if is_dist:
        raise CheckpointError(f"{load} is already torch_dist, which re-shards at load; there is "
                              f"nothing to convert")
    return torch_to_torch_dist(load, save)
