"""Checkpoints that can be moved: the files a checkpoint owns are referenced relative to it.

A converted checkpoint keeps the files of its origin inside itself and stores their
relative names: a Hugging Face directory's other files (tokenizer, generation config) in
`<checkpoint>/hf_files`, a fairseq model's dictionary (and the GPT-2 BPE files given) in
`<checkpoint>/fairseq`. When it is read, relative paths that exist inside the checkpoint are
resolved against its directory (and so is an absolute path into such a directory that no
longer exists: a checkpoint converted before the names were relative, then moved); a run
that continues from it carries its origin entry ("hf", "fairseq"), copies those files into
its own --save and stores the relative names again, so that the continued checkpoint
converts back as the original does.
"""
import os
import shutil
from typing import Any, Dict

FILES_DIR = "hf_files"
FAIRSEQ_DIR = "fairseq"
ORIGINS = {"hf": (FILES_DIR, "files_dir"), "fairseq": (FAIRSEQ_DIR, "dictionary")}
"""Each origin entry of a converted model's config: (the checkpoint's directory of that
origin's files, the entry's field that names a path inside the checkpoint)."""
_ORIGIN_DIRS = {directory for directory, _ in ORIGINS.values()}
PATH_FIELDS = ("vocab_file", "merge_file", "tokenizer_name_or_path", "tokenizer_model")


def _inside(root: str, value):
    """`value` resolved against the checkpoint `root` when it is relative and exists there,
    or when it is a missing absolute path into an origin directory that `root` has."""
    if not value:
        return value
    relative = value
    if os.path.isabs(value):
        parts = os.path.normpath(value).split(os.sep)
        dirs = [i for i, part in enumerate(parts) if part in _ORIGIN_DIRS]
        if os.path.exists(value) or not dirs:
            return value
        relative = os.path.join(*parts[dirs[-1]:])
    candidate = os.path.join(root, relative)
    return candidate if os.path.exists(candidate) else value


def resolve_stored_paths(stored: Dict[str, Any], root: str) -> Dict[str, Any]:
    """The stored config with its checkpoint-relative file references made usable."""
    data = stored.get("data")
    if isinstance(data, dict):
        for name in PATH_FIELDS:
            data[name] = _inside(root, data.get(name))
    for origin, (_, field) in ORIGINS.items():
        entry = stored.get(origin)
        if isinstance(entry, dict) and entry.get(field):
            entry[field] = _inside(root, entry[field])
    return stored


def carry_origin(config, stored: Dict[str, Any], load: str, rank: int) -> None:
    """What a run continued from the checkpoint directory `load` (Found.root) saves of its
    origin: the "hf" and "fairseq" entries, and the checkpoint's own files copied into --save
    (by rank 0) and referenced there by their relative names. Call after the tokenizer is
    built: it is read from `load`."""
    for origin, (directory, field) in ORIGINS.items():
        entry = dict(stored[origin]) if stored.get(origin) else None
        setattr(config, origin, entry)
        save, source = config.checkpoint.save, os.path.join(load, directory)
        if not save or not os.path.isdir(source):
            continue
        target = os.path.join(save, directory)
        if rank == 0 and os.path.abspath(source) != os.path.abspath(target):
            shutil.copytree(source, target, dirs_exist_ok=True)
        for name in PATH_FIELDS:
            setattr(config.data, name, _relative(getattr(config.data, name), source, load))
        if entry and entry.get(field):
            entry[field] = _relative(entry[field], source, load)


def copy_origin_files(load: str, save: str) -> None:
    """The origin directories of the checkpoint `load` (hf_files, fairseq) copied into the
    re-sharded `save`, so that its stored relative names resolve there too."""
    for directory in _ORIGIN_DIRS:
        source = os.path.join(load, directory)
        if os.path.isdir(source):
            shutil.copytree(source, os.path.join(save, directory), dirs_exist_ok=True)


def _relative(value, source: str, load: str):
    """`value` relative to the checkpoint `load` when it is inside its directory `source`."""
    if not value:
        return value
    path, source = os.path.abspath(value), os.path.abspath(source)
    if path == source or path.startswith(source + os.sep):
        return os.path.relpath(path, os.path.abspath(load))
    return value
