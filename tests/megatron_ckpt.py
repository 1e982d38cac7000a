"""Megatron-LM / Megatron-DeepSpeed checkpoint files written and read by the documented format,
key for key, independently of megatron/training/megatron_legacy.py (the code under test).

Format (legacy, non-distributed `model_optim_rng.pt`), by checkpoint_version:
- 3.0: model.language_model.{embedding, encoder}; `self_attention`; QKV rows [heads, (q,k,v), dim];
       opt_param_scheduler; rng_state = [{random_rng_state, np_rng_state, torch_rng_state,
       cuda_rng_state, rng_tracker_states}]
- 2.0: model.language_model.{embedding, transformer}; `attention`; QKV rows [heads, (q,k,v), dim];
       lr_scheduler; the five RNG keys at the top level
- 1.0: as 2.0 with QKV rows [heads, dim, (q,k,v)]
Every version: args (argparse.Namespace, consumed_train_samples / consumed_valid_samples in it),
checkpoint_version, iteration, optimizer (an fp32 run: the bare torch optimizer state).
"""
import argparse
import os
import random

import numpy as np
import torch

# What Megatron-LM's load_checkpoint / check_checkpoint_args read from args.
MEGATRON_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings",
                 "make_vocab_size_divisible_by", "padded_vocab_size", "tokenizer_type",
                 "tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "consumed_train_samples", "consumed_valid_samples", "iteration")
RNG_KEYS = ("random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state",
            "rng_tracker_states")


def _qkv_from_ours(tensor, version, heads):
    if version >= 2.0:
        return tensor
    rest = tensor.shape[1:]
    dim = tensor.shape[0] // (3 * heads)
    grouped = tensor.view(heads, 3, dim, *rest)
    return grouped.transpose(1, 2).contiguous().view(tensor.shape)  # [heads, dim, 3]


def megatron_model(nested: dict, version: float, heads: int) -> dict:
    """Our nested model state (checkpointing.to_megatron_layout) as a Megatron `model` entry."""
    lm = dict(nested["language_model"])
    encoder = {}
    for key, value in lm.pop("encoder").items():
        if "query_key_value" in key:
            value = _qkv_from_ours(value, version, heads)
        encoder[key if version >= 3.0 else key.replace(".self_attention.", ".attention.")] = value
    lm["encoder" if version >= 3.0 else "transformer"] = encoder
    return dict(nested, language_model=lm)


def _rng():
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.tensor([1234, 0], dtype=torch.int64).view(torch.uint8),
            "rng_tracker_states": {"model-parallel-rng": torch.tensor(
                [1234 + 2718, 0], dtype=torch.int64).view(torch.uint8)}}


def write_megatron_checkpoint(root, nested_model, version, args_values, iteration,
                              optimizer=None, scheduler=None) -> str:
    """Write one Megatron file (TP = PP = 1) and the tracker; returns the file's path."""
    args = argparse.Namespace(**args_values)
    state = {"args": args, "checkpoint_version": version, "iteration": iteration,
             "model": megatron_model(nested_model, version, args.num_attention_heads)}
    if optimizer is not None:
        state["optimizer"] = optimizer
    if scheduler is not None:
        state["opt_param_scheduler" if version >= 3.0 else "lr_scheduler"] = scheduler
    if version >= 3.0:
        state["rng_state"] = [_rng()]
    else:
        state.update(_rng())
    path = os.path.join(root, f"iter_{iteration:07d}", "mp_rank_00", "model_optim_rng.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(state, path)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return path


def read_megatron_checkpoint(path: str) -> dict:
    """Load a file as Megatron's loader would, with only the allowlist it needs."""
    allowed = [argparse.Namespace, np.ndarray, np.dtype, np._core.multiarray._reconstruct]
    allowed += [getattr(np.dtypes, n) for n in ("UInt32DType", "Int64DType") if hasattr(np, "dtypes")]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location="cpu", weights_only=True)


def missing_megatron_entries(state: dict) -> list:
    """What Megatron-LM and Megatron-DeepSpeed would look for in `state` and not find."""
    missing = [k for k in ("args", "checkpoint_version", "iteration", "model", "optimizer",
                           "opt_param_scheduler", "lr_scheduler", "rng_state") if k not in state]
    args = state.get("args")
    if not isinstance(args, argparse.Namespace):
        return missing + ["args (an argparse.Namespace)"]
    missing += [f"args.{name}" for name in MEGATRON_ARGS if not hasattr(args, name)]
    if state.get("checkpoint_version") != 3.0:
        missing.append("checkpoint_version 3.0")
    rng = state.get("rng_state")
    if not (isinstance(rng, list) and rng and all(k in rng[0] for k in RNG_KEYS)):
        missing.append("rng_state [{" + ", ".join(RNG_KEYS) + "}]")
    elif not isinstance(rng[0]["np_rng_state"][1], np.ndarray):
        missing.append("np_rng_state as numpy.random.get_state()")
    for key in ("opt_param_scheduler", "lr_scheduler"):
        sched = state.get(key, {})
        for name in ("max_lr", "min_lr", "num_steps"):
            if name not in sched:
                missing.append(f"{key}.{name}")
    lm = state.get("model", {}).get("language_model", {})
    if "encoder" not in lm or "embedding" not in lm:
        missing.append("model.language_model.{embedding, encoder}")
    return missing
