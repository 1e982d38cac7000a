"""Megatron-LM / Megatron-DeepSpeed checkpoint files, read and written in their format.

A Megatron `model_optim_rng.pt` (legacy, non-distributed format) holds:

    args                 argparse.Namespace of the run (consumed_train_samples lives here)
    checkpoint_version   0 (absent), 1.0, 2.0 or 3.0
    iteration            int
    model                {"language_model": {"embedding": {...}, "encoder" | "transformer": {...}},
                          "word_embeddings_for_head": {...} on the last stage with PP > 1}
    optimizer            {"optimizer": torch state, "grad_scaler", "fp32_from_fp16_params": [[...]]}
    opt_param_scheduler  (Megatron-LM) / lr_scheduler (Megatron-DeepSpeed, older Megatron-LM)
    rng_state            [{random_rng_state, np_rng_state, torch_rng_state, cuda_rng_state,
                           rng_tracker_states}] (older: these five keys at the top level)

Loading uses torch.load(weights_only=True) with an explicit allowlist (`SAFE_GLOBALS`):
argparse.Namespace and what a numpy RNG state needs; anything else is refused by name.
`to_ours` turns such a file into our state (QKV rows of versions < 2.0 reordered, old key
names mapped, counters taken from args); `add_megatron_entries` adds to our state what
Megatron's loaders read, so Megatron resumes our checkpoints. Sinusoidal positions (fairseq's
fixed table, recomputed from the config and never saved by our model) have no Megatron
kind: our files describe them to Megatron as learned absolute positions whose weight is the
table, the same function; `drop_megatron_only` removes that weight again when we read our
own file.
"""
import argparse
import dataclasses
import pickle
from typing import Any, Dict, List

import numpy as np
import torch

from megatron.checkpointing.experts import stack_megatron_experts
from megatron.model.positions import sinusoidal_table
from megatron.optimizer.optimizer import decay_flags, regular_order

MEGATRON_VERSION = 3.0


def _safe_globals() -> List[Any]:
    reconstruct = np._core.multiarray._reconstruct if hasattr(np, "_core") \
        else np.core.multiarray._reconstruct
    allowed = [argparse.Namespace, np.ndarray, np.dtype, reconstruct,
               (reconstruct, "numpy.core.multiarray._reconstruct"),  # files written by numpy < 2
               (reconstruct, "numpy._core.multiarray._reconstruct")]
    dtypes = getattr(np, "dtypes", None)
    for name in ("UInt32DType", "Int64DType", "Float64DType", "Float32DType"):
        if dtypes is not None and hasattr(dtypes, name):
            allowed.append(getattr(dtypes, name))
    return allowed


SAFE_GLOBALS = _safe_globals()


class UnusableCheckpoint(RuntimeError):
    """A checkpoint file holds something that cannot be loaded safely; the message names it."""


def safe_load(path: str, **kwargs) -> Dict[str, Any]:
    """torch.load(weights_only=True) that also admits argparse.Namespace and numpy RNG states."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        raise UnusableCheckpoint(f"{path}: {_refusal(path, err)}; it was not loaded (weights_only "
                                 f"loading runs no code from a file)") from None


def _refusal(path: str, err: Exception) -> str:
    try:
        names = [n for n in torch.serialization.get_unsafe_globals_in_checkpoint(path)
                 if n not in _allowed_names()]
    except Exception:  # not a zip checkpoint at all
        names = []
    if names:
        return f"holds objects of {', '.join(names)}, which are not plain data"
    return str(err).strip().splitlines()[0]


def _allowed_names():
    names = set()
    for item in SAFE_GLOBALS:
        if isinstance(item, tuple):
            names.add(item[1])
        else:
            names.add(f"{item.__module__}.{item.__qualname__}")
    return names


# -- Megatron's files -> our state ------------------------------------------------------------
def is_megatron_file(state: dict) -> bool:
    """Megatron's files carry `args` and no `config` (ours carry both)."""
    return "config" not in state and ("args" in state or "checkpoint_version" in state)


def reorder_qkv(tensor: torch.Tensor, version: float, heads: int) -> torch.Tensor:
    """QKV rows of a checkpoint `version` < 2.0 into [heads, (q, k, v), head dim] (ours, 2.0+).

    version 0 stores [(q, k, v), heads, head dim]; version 1.0 [heads, head dim, (q, k, v)].
    `heads` are the heads of this tensor-parallel shard.
    """
    if version >= 2.0:
        return tensor
    rest = tensor.shape[1:]
    head_dim = tensor.shape[0] // (3 * heads)
    if version == 0:
        out = tensor.view(3, heads, head_dim, *rest).transpose(0, 1)
    else:
        out = tensor.view(heads, head_dim, 3, *rest).transpose(1, 2)
    return out.contiguous().view(tensor.shape)


def _encoder_of(language_model: dict, version: float, heads: int) -> dict:
    encoder = language_model.get("encoder", language_model.get("transformer", {}))
    mapped = {}
    for key, value in encoder.items():
        key = key.replace(".attention.", ".self_attention.")
        if key.endswith("query_key_value.weight") or key.endswith("query_key_value.bias"):
            value = reorder_qkv(value, version, heads)
        mapped[key] = value
    return stack_megatron_experts(mapped)  # MoE layers' per-expert tensors, stacked


def _model_to_ours(model: dict, version: float, heads: int) -> dict:
    lm = dict(model.get("language_model", {}))
    lm["encoder"] = _encoder_of(lm, version, heads)
    lm.pop("transformer", None)
    out = dict(model)
    out["language_model"] = lm
    return out


def _rng_entry(state: dict):
    """The RNG dict of a file: the first of Megatron's per-rank list, or the old top-level keys."""
    entry = state.get("rng_state")
    if isinstance(entry, list):
        entry = entry[0] if entry else None
    if entry is None and "random_rng_state" in state:
        entry = {k: state[k] for k in ("random_rng_state", "np_rng_state", "torch_rng_state",
                                       "cuda_rng_state", "rng_tracker_states") if k in state}
    return entry


def rng_entry_to_ours(entry: dict, current_device_state, current_tracker: dict) -> dict:
    """Megatron's RNG entry (or ours in Megatron's list) in the form set_rng_state takes.

    CUDA generator states cannot seed a CPU run: without CUDA the device generator is the
    torch generator and tracker states of another kind keep this run's (seeded) ones."""
    out = dict(entry)
    name, keys, pos, has_gauss, cached = entry["np_rng_state"]
    if isinstance(keys, np.ndarray):
        keys = torch.from_numpy(keys.astype(np.int64))
    out["np_rng_state"] = (name, keys, pos, has_gauss, cached)
    if "device_rng_state" not in out:
        cuda = out.get("cuda_rng_state")
        fits = cuda is not None and cuda.numel() == current_device_state.numel()
        out["device_rng_state"] = cuda if fits else out["torch_rng_state"]
    tracker = out.get("device_rng_tracker_states", out.get("rng_tracker_states", {}))
    fits = all(name in tracker and tracker[name].numel() == state.numel()
               for name, state in current_tracker.items())
    out["rng_tracker_states"] = tracker if fits else current_tracker
    return out


# Megatron-LM's MoE args that shape the model (its names are MoEConfig's); the training ones
# (load balancing, dispatcher, capacity) stay with the flags of each run.
MOE_MODEL_ARGS = ("num_experts", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_topk",
                  "moe_router_score_function", "moe_router_pre_softmax",
                  "moe_router_topk_scaling_factor", "moe_router_num_groups",
                  "moe_router_group_topk", "moe_router_enable_expert_bias",
                  "moe_shared_expert_intermediate_size", "moe_shared_expert_gate")


def stored_config_from_args(args) -> dict:
    """The parts of our Config dict that Megatron's args determine (model and tokenizer)."""
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    model = {name: get(name) for name in (
        "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
        "max_position_embeddings", "padded_vocab_size", "make_vocab_size_divisible_by",
        "kv_channels", "num_query_groups", "group_query_attention", "position_embedding_type",
        "normalization", "untie_embeddings_and_output_weights", "add_bias_linear")}
    model["layernorm_epsilon"] = get("norm_epsilon", get("layernorm_epsilon"))
    model["apply_query_key_layer_scaling"] = get("apply_query_key_layer_scaling")
    if get("swiglu"):
        model["activation"] = "swiglu"
    if get("num_experts"):
        model["moe"] = {name: get(name) for name in MOE_MODEL_ARGS if get(name) is not None}
    data = {name: get(name) for name in ("tokenizer_type", "vocab_file", "merge_file")}
    data["tokenizer_name_or_path"] = get("tokenizer_name_or_path")
    return {"model": {k: v for k, v in model.items() if v is not None},
            "data": {k: v for k, v in data.items() if v is not None}}


def to_ours(state: dict) -> dict:
    """A Megatron file's state in our layout (model, counters, layout, scheduler, RNG)."""
    args = state.get("args") or argparse.Namespace()
    version = float(state.get("checkpoint_version", 0))
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    heads = (getattr(args, "num_attention_heads", None) or 0) // tp
    if version < 2.0 and not heads:
        raise UnusableCheckpoint(f"checkpoint version {version} needs args.num_attention_heads "
                                 f"to reorder its QKV rows, and its args have none")
    out = {key: value for key, value in state.items() if key not in ("args", "rng_state")}
    for key in _model_keys(state):
        out[key] = _model_to_ours(state[key], version, heads)
    out["consumed_train_samples"] = int(getattr(args, "consumed_train_samples", 0) or 0)
    out["consumed_valid_samples"] = int(getattr(args, "consumed_valid_samples", 0) or 0)
    out["parallel"] = {"tensor_model_parallel_size": tp,
                       "pipeline_model_parallel_size":
                           getattr(args, "pipeline_model_parallel_size", 1) or 1}
    out["megatron_config"] = stored_config_from_args(args)
    if "opt_param_scheduler" not in out and "lr_scheduler" in state:
        out["opt_param_scheduler"] = state["lr_scheduler"]
    rng = _rng_entry(state)
    if rng is not None:
        out["rng_state"] = rng
    return out


# -- our state -> what Megatron's loaders read --------------------------------------------------
def _philox_state(seed: int) -> torch.Tensor:
    """A CUDA generator state (seed, offset 0) for Megatron to load from a CPU-trained run."""
    return torch.tensor([seed, 0], dtype=torch.int64).view(torch.uint8)


def megatron_rng_entry(ours: dict, seed: int, tp_rank: int) -> dict:
    """Our RNG dict with Megatron's keys added (numpy state as numpy, CUDA states)."""
    entry = dict(ours)
    name, keys, pos, has_gauss, cached = ours["np_rng_state"]
    entry["np_rng_state"] = (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached)
    if torch.cuda.is_available():
        entry["cuda_rng_state"] = ours["device_rng_state"]
        return entry
    entry["cuda_rng_state"] = _philox_state(seed)
    entry["device_rng_tracker_states"] = ours["rng_tracker_states"]
    entry["rng_tracker_states"] = {name: _philox_state(seed + 2718 + tp_rank)
                                   for name in ours["rng_tracker_states"]}
    return entry


def megatron_args(config, pstate, iteration: int, consumed_train: int, consumed_valid: int):
    """argparse.Namespace with Megatron's names for what its loaders check and read."""
    m, t, o, d, p = config.model, config.training, config.optimizer, config.data, config.parallel
    dtype = torch.float16 if t.fp16 else torch.bfloat16 if t.bf16 else torch.float32
    return argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, kv_channels=m.kv_channels,
        group_query_attention=m.group_query_attention, num_query_groups=m.num_query_groups,
        seq_length=m.seq_length, max_position_embeddings=m.max_position_embeddings,
        position_embedding_type=_megatron_positions(m.position_embedding_type),
        add_position_embedding=_megatron_positions(m.position_embedding_type) == "learned_absolute",
        use_rotary_position_embeddings=m.position_embedding_type == "rope",
        normalization=m.normalization, layernorm_epsilon=m.layernorm_epsilon,
        norm_epsilon=m.layernorm_epsilon, swiglu=m.activation == "swiglu",
        add_bias_linear=m.add_bias_linear,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        apply_query_key_layer_scaling=m.apply_query_key_layer_scaling,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        padded_vocab_size=m.padded_vocab_size, tokenizer_type=d.tokenizer_type,
        vocab_file=d.vocab_file, merge_file=d.merge_file,
        tensor_model_parallel_size=pstate.tp_size, pipeline_model_parallel_size=pstate.pp_size,
        virtual_pipeline_model_parallel_size=config.virtual_pipeline_size,
        pipeline_model_parallel_layout=p.pipeline_model_parallel_layout,
        decoder_first_pipeline_num_layers=p.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=p.decoder_last_pipeline_num_layers,
        data_parallel_size=pstate.dp_size, use_distributed_optimizer=p.use_distributed_optimizer,
        micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size,
        train_iters=t.train_iters, train_samples=t.train_samples, seed=t.seed,
        lr=o.lr, min_lr=o.min_lr, lr_decay_style=o.lr_decay_style, weight_decay=o.weight_decay,
        clip_grad=o.clip_grad, fp16=t.fp16, bf16=t.bf16, params_dtype=dtype,
        iteration=iteration, consumed_train_samples=consumed_train,
        consumed_valid_samples=consumed_valid, data_parallel_random_init=False,
        **_megatron_moe_args(m.moe, p))


def _megatron_moe_args(moe, parallel) -> dict:
    """Megatron-LM's MoE args (MoEConfig's fields, under the same names; num_experts None
    for a dense model) and expert parallel sizes, which its checkpoint converters read."""
    fields = (dataclasses.asdict(moe) if moe is not None and moe.enabled
              else {"num_experts": None})
    return {**fields, "expert_model_parallel_size": parallel.expert_model_parallel_size,
            "expert_tensor_parallel_size": parallel.expert_tp}


def _megatron_positions(kind: str) -> str:
    """Megatron's position embedding type for ours (sinusoidal: learned_absolute, whose
    weight add_megatron_entries writes)."""
    return "learned_absolute" if kind == "sinusoidal" else kind


def _model_keys(state: dict) -> List[str]:
    return [k for k in state if k == "model" or (k.startswith("model") and k[5:].isdigit())]


def _sinusoidal_embeddings(state: dict) -> List[dict]:
    """The embedding dicts (Megatron's nested layout) of the chunks that hold the embedding."""
    return [state[k]["language_model"]["embedding"] for k in _model_keys(state)
            if "embedding" in state[k].get("language_model", {})]


def add_megatron_entries(state: dict, config, pstate, optimizer) -> None:
    """Add to our checkpoint state what Megatron-LM's and Megatron-DeepSpeed's loaders read."""
    state["args"] = megatron_args(config, pstate, state["iteration"],
                                  state["consumed_train_samples"], state["consumed_valid_samples"])
    m = config.model
    if m.position_embedding_type == "sinusoidal":  # replicated over TP, first stage only
        for embedding in _sinusoidal_embeddings(state):
            dtype = embedding["word_embeddings"]["weight"].dtype
            table = sinusoidal_table(m.max_position_embeddings, m.hidden_size).to(dtype)
            embedding["position_embeddings"] = {"weight": table}
    state["checkpoint_version"] = MEGATRON_VERSION
    if "opt_param_scheduler" in state:
        state["lr_scheduler"] = state["opt_param_scheduler"]
    if "rng_state" in state:
        state["rng_state"] = [megatron_rng_entry(state["rng_state"], config.training.seed
                                                 + 100 * pstate.pp_rank, pstate.tp_rank)]
    saved = state.get("optimizer")
    if saved is not None and "fp32_from_fp16_params" in saved:
        state["optimizer"] = dict(saved, fp32_from_fp16_params=[
            [p.detach().clone() for p in group["params"]] for group in optimizer.param_groups])


def drop_megatron_only(state: dict) -> dict:
    """Our file `state` without what add_megatron_entries wrote for Megatron alone: the
    sinusoidal table as a position embedding weight (our model recomputes it)."""
    model = (state.get("config") or {}).get("model") or {}
    if model.get("position_embedding_type") == "sinusoidal":
        for embedding in _sinusoidal_embeddings(state):
            embedding.pop("position_embeddings", None)
    return state


def optimizer_to_ours(saved: dict, models) -> dict:
    """Megatron's optimizer entry in ours: an fp32 run's bare torch state wrapped, per-group
    fp32_from_fp16_params back in our flat order (the models' parameters)."""
    if "state" in saved and "param_groups" in saved:  # Megatron's FP32Optimizer saves it bare
        return {"optimizer": saved}
    groups = saved.get("fp32_from_fp16_params")
    if not groups or not isinstance(groups[0], (list, tuple)):
        return saved
    params = [p for m in models for p in m.parameters() if p.requires_grad]
    order = regular_order(decay_flags(models))
    flat = [value for group in groups for value in group]
    if len(flat) != len(params):
        raise UnusableCheckpoint(f"the checkpoint's optimizer holds {len(flat)} fp32 parameters, "
                                 f"the model has {len(params)}")
    ours = [None] * len(params)
    for position, value in zip(order, flat):
        ours[position] = value
    return dict(saved, fp32_from_fp16_params=ours)
