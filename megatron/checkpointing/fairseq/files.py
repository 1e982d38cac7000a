"""Reading and writing fairseq checkpoint files.

fairseq saves `{"args": Namespace | None, "cfg": dict | None, "model": state dict,
"optimizer_history": [...], "extra_state": {...}, ...}`. Model-parallel training
writes one `<name>-model_part-K.pt` per rank K, split by fairseq's (Megatron's)
rules: q/k/v projections, fc1 and the embedding (and a separate output projection)
are column-parallel, split on dim 0 with their biases; out_proj and fc2 are
row-parallel, weights split on dim 1, biases replicated; norms are replicated.
"""
import argparse
import glob
import os
import re
from typing import Dict, List, Tuple

import torch

from megatron.checkpointing.fairseq import FairseqError
from megatron.checkpointing.io import save_file
from megatron.checkpointing.megatron_legacy import UnusableCheckpoint, safe_load

PART = re.compile(r"^(?P<name>.+)-model_part-(?P<rank>\d+)\.pt$")
COLUMN = re.compile(r"(embed_tokens|output_projection)\.weight$|"
                    r"self_attn\.(q|k|v)_proj\.(weight|bias)$|fc1\.(weight|bias)$")
ROW = re.compile(r"(self_attn\.out_proj|fc2)\.weight$")


def partition_dim(name: str):
    """0 (column-parallel), 1 (row-parallel) or None (replicated) for a fairseq tensor."""
    if COLUMN.search(name):
        return 0
    if ROW.search(name):
        return 1
    return None


def find_files(load: str) -> List[str]:
    """The checkpoint file(s) `load` names: a file, partitions of it, or a directory's."""
    if os.path.isfile(load):
        return [load]
    if load.endswith(".pt"):
        parts = glob.glob(load[:-3] + "-model_part-*.pt")
        if parts:
            return _ordered_parts(parts)
        raise FairseqError(f"--load {load}: no such file, nor partitions "
                           f"{load[:-3]}-model_part-K.pt")
    if not os.path.isdir(load):
        raise FairseqError(f"--load {load}: no such file or directory")
    parts = [p for p in glob.glob(os.path.join(load, "*.pt")) if PART.match(os.path.basename(p))]
    if parts:
        return _ordered_parts(parts)
    files = sorted(glob.glob(os.path.join(load, "*.pt")))
    if len(files) != 1:
        raise FairseqError(f"--load {load} holds {len(files)} .pt files; name the checkpoint "
                           f"file (e.g. {os.path.join(load, 'model.pt')})")
    return files


def _ordered_parts(paths: List[str]) -> List[str]:
    names = {PART.match(os.path.basename(p)).group("name") for p in paths}
    if len(names) > 1:
        raise FairseqError(f"partitions of {len(names)} checkpoints ({', '.join(sorted(names))}) "
                           f"found; name one with --load DIR/NAME.pt")
    return sorted(paths, key=lambda p: int(PART.match(os.path.basename(p)).group("rank")))


def load_state(path: str) -> dict:
    """One fairseq file, loaded with weights_only (argparse.Namespace allowed, no code run)."""
    try:
        state = safe_load(path)
    except UnusableCheckpoint as err:
        raise FairseqError(str(err)) from None
    except (OSError, RuntimeError) as err:
        raise FairseqError(f"cannot read {path}: {str(err).strip().splitlines()[0]}") from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise FairseqError(f"{path} is not a fairseq checkpoint (no 'model' state dict)")
    return state


def model_args(state: dict) -> Dict:
    """fairseq's model and task settings as one flat dict (`args` or `cfg`)."""
    args = state.get("args")
    if isinstance(args, argparse.Namespace):
        return dict(vars(args))
    cfg = state.get("cfg")
    if not isinstance(cfg, dict):
        raise FairseqError("the checkpoint has neither 'args' nor 'cfg'; it is not a fairseq "
                           "checkpoint or it was stripped of its settings")
    flat = {}
    for section in ("common", "task", "model"):
        value = cfg.get(section) or {}
        flat.update(vars(value) if isinstance(value, argparse.Namespace) else dict(value))
    return flat


def model_parallel_size(args: Dict) -> int:
    return int(args.get("model_parallel_size") or 1)


def _check_parts(paths: List[str], states: List[dict], expected: int) -> None:
    ranks = [int(PART.match(os.path.basename(p)).group("rank")) for p in paths]
    missing = sorted(set(range(expected)) - set(ranks))
    surplus = sorted(set(ranks) - set(range(expected)))
    name = PART.match(os.path.basename(paths[0])).group("name")
    if missing:
        raise FairseqError(f"partition(s) {', '.join(map(str, missing))} of {expected} missing "
                           f"for {name}-model_part-K.pt (model_parallel_size {expected}); all "
                           f"partitions are needed")
    if surplus:
        raise FairseqError(f"partition(s) {', '.join(map(str, surplus))} unexpected for "
                           f"{name}-model_part-K.pt: its model_parallel_size is {expected} "
                           f"(partitions 0 to {expected - 1}); remove the others or fix the "
                           f"checkpoint's model_parallel_size")
    first = states[0]["model"]
    for path, state in zip(paths[1:], states[1:]):
        model = state["model"]
        if set(model) != set(first):
            raise FairseqError(f"{path} has other tensors than {paths[0]}; the partitions are "
                               f"not of one checkpoint")
        for name, t in model.items():
            if tuple(t.shape) != tuple(first[name].shape):
                raise FairseqError(f"{name} is {tuple(t.shape)} in {path} but "
                                   f"{tuple(first[name].shape)} in {paths[0]}: partitions of "
                                   f"different sizes are not one checkpoint")


def merge_partitions(models: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Full tensors from model-parallel state dicts by fairseq's splitting rules."""
    merged = {}
    for name, tensor in models[0].items():
        dim = partition_dim(name)
        merged[name] = tensor if dim is None else torch.cat([m[name] for m in models], dim=dim)
    return merged


def read_checkpoint(load: str) -> Tuple[Dict[str, torch.Tensor], dict, List[str]]:
    """(full state dict, the first file's state, the files read) of `load`."""
    paths = find_files(load)
    states = [load_state(p) for p in paths]
    if len(paths) == 1 and not PART.match(os.path.basename(paths[0])):
        return states[0]["model"], states[0], paths
    expected = model_parallel_size(model_args(states[0]))
    _check_parts(paths, states, expected)
    return merge_partitions([s["model"] for s in states]), states[0], paths


def write_checkpoint(path: str, state: dict) -> None:
    save_file(state, path)
