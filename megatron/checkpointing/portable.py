"""Checkpoints that can be moved: the files a checkpoint owns are referenced relative to it.

A converted checkpoint keeps the Hugging Face directory's other files (tokenizer,
generation config) in `<checkpoint>/hf_files` and stores that relative name. When it is
read, relative paths that exist inside the checkpoint are resolved against its
directory; a run that continues from it copies those files into its own --save and
stores the relative name again.
"""
import os
import shutil
from typing import Any, Dict

FILES_DIR = "hf_files"
PATH_FIELDS = ("vocab_file", "merge_file", "tokenizer_name_or_path", "tokenizer_model")


def _inside(root: str, value):
    """`value` resolved against the checkpoint `root` when it is relative and exists there."""
    if not value or os.path.isabs(value):
        return value
    candidate = os.path.join(root, value)
    return candidate if os.path.exists(candidate) else value


def resolve_stored_paths(stored: Dict[str, Any], root: str) -> Dict[str, Any]:
    """The stored config with its checkpoint-relative file references made usable."""
    data = stored.get("data")
    if isinstance(data, dict):
        for name in PATH_FIELDS:
            data[name] = _inside(root, data.get(name))
    hf = stored.get("hf")
    if isinstance(hf, dict) and hf.get("files_dir"):
        hf["files_dir"] = _inside(root, hf["files_dir"])
    return stored


def carry_origin(config, stored: Dict[str, Any], load: str, rank: int) -> None:
    """What a run continued from the checkpoint `load` saves of its origin: the "hf" entry,
    and the checkpoint's own files copied into --save (by rank 0) and referenced there by
    their relative name. Call after the tokenizer is built: it is read from `load`."""
    config.hf = dict(stored["hf"]) if stored.get("hf") else None
    save, source = config.checkpoint.save, os.path.join(load, FILES_DIR)
    if not save or not os.path.isdir(source):
        return
    target = os.path.join(save, FILES_DIR)
    if rank == 0 and os.path.abspath(source) != os.path.abspath(target):
        shutil.copytree(source, target, dirs_exist_ok=True)
    prefix = os.path.abspath(source)
    for name in PATH_FIELDS:
        value = getattr(config.data, name)
        if value and os.path.abspath(value).startswith(prefix):
            setattr(config.data, name, os.path.relpath(os.path.abspath(value),
                                                        os.path.abspath(load)))
    if config.hf and config.hf.get("files_dir"):
        config.hf["files_dir"] = FILES_DIR
