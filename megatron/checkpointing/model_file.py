"""One rank's file of Megatron's per-rank layout, `model_optim_rng.pt`, read and placed.

    <iteration dir>/mp_rank_TT/model_optim_rng.pt          (PP = 1)
    <iteration dir>/mp_rank_TT_PPP/model_optim_rng.pt      (PP > 1: TP rank, PP rank)
    <iteration dir>/mp_rank_TT[_PPP]_EEE/…                 (EP > 1: the EP rank too)
    <iteration dir>/mp_rank_TT[_PPP]/distrib_optim_dp_DDD.pt   (distributed optimizer shards)

The model sits in Megatron's nested key layout (`model`, or `model0`, `model1`… for virtual
pipeline chunks); our files and Megatron-LM's read alike (megatron_legacy.py converts
theirs). Used by the torch format, the Megatron-LM format and the re-sharding tools.
"""
import functools
import os
import re
from typing import Dict, Optional

import torch

from megatron.checkpointing import io, megatron_legacy
from megatron.checkpointing.experts import rank_dir_name
from megatron.checkpointing.finite import finite_model_state
from megatron.checkpointing.io import CheckpointError
from megatron.files import file_sha256
from megatron.checkpointing.tracker import iteration_dir

MODEL_FILE = "model_optim_rng.pt"
TOKENIZER_FILE_FIELDS = ("vocab_file", "merge_file", "tokenizer_model")
_SHARD_FILE = re.compile(r"^distrib_optim_dp_(\d{3,})\.pt$")


def rank_file(directory: str, tp_rank: int, pp_rank: int, pp_size: int,
              ep_rank: Optional[int] = None) -> str:
    """A rank's model file in the iteration `directory`."""
    return os.path.join(directory, rank_dir_name(tp_rank, pp_rank, pp_size, ep_rank), MODEL_FILE)


def checkpoint_path(root: str, iteration: int, tp_rank: int, pp_rank: int, pp_size: int,
                    release: bool = False, ep_rank: Optional[int] = None) -> str:
    return rank_file(iteration_dir(root, iteration, release), tp_rank, pp_rank, pp_size, ep_rank)


def shard_path(directory: str, tp_rank: int, pp_rank: int, pp_size: int, dp_rank: int) -> str:
    """A DP rank's distributed-optimizer shard in the iteration `directory`."""
    rank_dir = os.path.dirname(rank_file(directory, tp_rank, pp_rank, pp_size))
    return os.path.join(rank_dir, f"distrib_optim_dp_{dp_rank:03d}.pt")


def shard_files(directory: str, from_rank: int = 0) -> list:
    """The distributed-optimizer shard files in one rank directory (DP rank >= `from_rank`)."""
    found = sorted((int(m.group(1)), name) for name in os.listdir(directory)
                   if (m := _SHARD_FILE.match(name)))
    return [os.path.join(directory, name) for rank, name in found if rank >= from_rank]


def first_rank_file(directory: str) -> Optional[str]:
    """One rank's file in an iteration directory (any rank will do), or None."""
    ranks = sorted(d for d in os.listdir(directory) if d.startswith("mp_rank_")) \
        if os.path.isdir(directory) else []
    for rank_dir in ranks:
        path = os.path.join(directory, rank_dir, MODEL_FILE)
        if os.path.isfile(path):
            return path
    return None


# -- model state in Megatron's nested layout -----------------------------------
_EMBEDDING = "language_model.embedding."
_ENCODER = "language_model.encoder."
_HEAD = "word_embeddings_for_head."
_OUTPUT = "language_model.output_layer."
_MTP = "mtp.layers."


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
        elif key.startswith(_MTP):  # flat, as in Megatron-LM's (Megatron-Core) models
            nested[key] = value
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
    flat.update((key, value) for key, value in nested.items() if key.startswith(_MTP))
    return flat


def is_chunk_key(key: str) -> bool:
    """Whether a state key holds one virtual pipeline chunk (`model0`, `model1`…)."""
    return key.startswith("model") and key[5:].isdigit()


def model_key(i: int, n: int) -> str:
    """The state's key of chunk `i` of `n` (Megatron's `model`, `model0`, `model1`…)."""
    return "model" if n == 1 else f"model{i}"


def sharding_of(models) -> Dict[str, dict]:
    """How each parameter of this rank's chunks is split over TP (megatron.mpu.sharding);
    the chunks share parameter names, so one dict serves them all."""
    meta: Dict[str, dict] = {}
    for model in models:
        meta.update(model.sharding_metadata())
    return meta


def read_model_file(path: str, verify: bool = True, mmap: bool = False) -> dict:
    """One model_optim_rng.pt, ours or Megatron's (see megatron_legacy), in our layout;
    checksum-verified unless `verify` is False. Any problem is a one-line CheckpointError."""
    state = io.load_file(path, verify, mmap)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a checkpoint dict")
    if megatron_legacy.is_megatron_file(state):
        return megatron_legacy.to_ours(state)
    return megatron_legacy.drop_megatron_only(state)


def load_into_models(state: dict, models, root: str) -> None:
    """Each chunk's weights from a rank file's state (strict; finite values only)."""
    for i, model in enumerate(models):
        try:
            flat = from_megatron_layout(state[model_key(i, len(models))])
        except (KeyError, AttributeError, TypeError) as err:
            raise _misfit(root, err) from None
        finite_model_state(flat, root)  # the file's own problem, never taken for the flags'
        try:
            model.load_state_dict(flat, strict=True)
        except (KeyError, RuntimeError, AttributeError, TypeError) as err:
            raise _misfit(root, err) from None


def _misfit(root: str, err: Exception) -> CheckpointError:
    first = (str(err).strip().splitlines() or [repr(err)])[0]
    return CheckpointError(f"checkpoint {root} does not fit the model built from the flags "
                           f"({first}); check the model flags")


def check_layout(state: dict, pstate, num_chunks: int, root: str,
                 split: Optional[str] = None) -> None:
    """Refuse a checkpoint saved with another TP / PP / virtual-PP / EP layout, or another
    pipeline split (`split`: the run's layout string, RunState.pipeline_split; checkpoints
    saved before it was recorded are not checked for it)."""
    saved = state.get("parallel", {})
    if split is not None and saved.get("pipeline_layout", split) != split:
        raise CheckpointError(f"checkpoint {root} was saved under the pipeline layout "
                              f"{saved['pipeline_layout']!r}, this run's is {split!r}; use the "
                              f"saved split or load it with --universal-checkpoint")
    expected = {"tensor_model_parallel_size": pstate.tp_size,
                "pipeline_model_parallel_size": pstate.pp_size,
                "virtual_pipeline_model_parallel_size": num_chunks,
                "expert_model_parallel_size": pstate.ep_size}
    if "tensor_model_parallel_size" in saved:  # absent: expert TP was TP
        expected["expert_tensor_parallel_size"] = pstate.etp_size
        saved = {"expert_tensor_parallel_size": saved["tensor_model_parallel_size"], **saved}
    for key, value in expected.items():
        if key in saved and saved[key] != value:
            raise CheckpointError(
                f"checkpoint {root} has {key}={saved[key]} but this run has {value}; use the "
                f"saved layout or re-shard with tools/merge_mp_partitions.py")


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
    return file_sha256(path)
