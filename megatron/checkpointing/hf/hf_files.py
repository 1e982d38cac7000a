"""Reading and writing Hugging Face model directories (config.json + safetensors)."""
import json
import os
import shutil
from typing import Dict

import torch

from megatron.checkpointing.hf import ConversionError
from megatron.files import publish

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Files that are weights or the model config; everything else in an HF directory
# (tokenizer files, generation_config.json, ...) travels along unchanged.
_MODEL_FILES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt", ".index.json")


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise ConversionError("the safetensors package is needed: pip install safetensors") \
            from None
    return safetensors.torch


def read_config(directory: str) -> dict:
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path):
        raise ConversionError(f"{path} not found: --load must be a Hugging Face model directory")
    with open(path) as f:
        return json.load(f)


def read_weights(directory: str) -> Dict[str, torch.Tensor]:
    """All tensors of model.safetensors or of the shards listed in its index."""
    st = _safetensors()
    single, index = os.path.join(directory, WEIGHTS), os.path.join(directory, INDEX)
    if os.path.isfile(single):
        return st.load_file(single)
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        weights = {}
        for shard in shards:
            weights.update(st.load_file(os.path.join(directory, shard)))
        return weights
    raise ConversionError(f"no {WEIGHTS} or {INDEX} in {directory}; save the model with "
                          f"safetensors (save_pretrained(..., safe_serialization=True))")


def other_files(directory: str):
    """Names of the files that are neither weights nor config.json (tokenizer files...)."""
    return sorted(name for name in os.listdir(directory)
                  if os.path.isfile(os.path.join(directory, name)) and name != CONFIG
                  and not name.endswith(_MODEL_FILES))


def copy_other_files(source: str, target: str) -> list:
    names = other_files(source)
    os.makedirs(target, exist_ok=True)
    for name in names:
        shutil.copy2(os.path.join(source, name), os.path.join(target, name))
    return names


def _write_json(path: str, content: dict) -> None:
    with open(path, "w") as f:
        json.dump(content, f, indent=2, sort_keys=True)
        f.write("\n")


def write_hf_dir(directory: str, config: dict, weights: Dict[str, torch.Tensor],
                 extra_files_from: str = None, defaults: Dict[str, dict] = None) -> None:
    """config.json + model.safetensors (+ the other files of `extra_files_from`, and the
    JSON files of `defaults` {name: content} that it lacks), written under a temporary
    name and renamed into place."""
    if os.path.exists(directory) and os.listdir(directory):
        raise ConversionError(f"--save {directory} exists and is not empty; choose a new directory")
    tmp = f"{directory.rstrip(os.sep)}.tmp.{os.getpid()}"
    os.makedirs(tmp)
    try:
        tensors = {name: t.detach().contiguous().clone() for name, t in weights.items()}
        _safetensors().save_file(tensors, os.path.join(tmp, WEIGHTS), metadata={"format": "pt"})
        _write_json(os.path.join(tmp, CONFIG), config)
        if extra_files_from and os.path.isdir(extra_files_from):
            copy_other_files(extra_files_from, tmp)
        for name, content in (defaults or {}).items():
            if not os.path.exists(os.path.join(tmp, name)):
                _write_json(os.path.join(tmp, name), content)
        if os.path.isdir(directory):
            os.rmdir(directory)
        publish(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
