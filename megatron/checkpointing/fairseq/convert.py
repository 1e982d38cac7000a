"""fairseq checkpoint (+ dict.txt) <-> our checkpoint at any TP / PP.

fairseq -> ours: the file or partitions are read and merged, the settings mapped
(mapping.model_fields), the dictionary read and checked against the embedding rows,
the vocabulary padded with zero rows (their logits are masked to -inf through the
tokenizer's size) and the result written as a `release` checkpoint, re-sharded to
the target layout. The rows keep fairseq's dictionary order: the checkpoint's
tokenizer is FairseqGPT2BPETokenizer over a copy of dict.txt (<save>/fairseq/dict.txt),
which maps GPT-2 ids to those rows; the GPT-2 BPE files given are copied there too, and
all are stored by their names relative to the checkpoint (portable.py), so a moved
checkpoint still evaluates and samples. The config keeps a "fairseq" entry (the original
cfg / args, the dictionary) for the way back, which training carries on.

ours -> fairseq: a checkpoint converted from fairseq becomes one model.pt (and
dict.txt) that fairseq-eval-lm loads, with its original settings.
"""
import argparse
import os
import shutil
from typing import Optional

from megatron.checkpointing.fairseq import FairseqError, files, mapping
from megatron.checkpointing.hf import common as c
from megatron.checkpointing.hf.convert import (TrackedTensors, VocabOptions, build_config,
                                               check_target_layout, read_full_model,
                                               sharding_for, write_release)
from megatron.checkpointing.hf.layouts import pad_rows
from megatron.checkpointing.portable import FAIRSEQ_DIR
from megatron.checkpointing.tracker import TRACKER
from megatron.config import Config
from megatron.tokenizer.fairseq_dict import DictionaryError, gpt2_ids, read_dictionary

DICT = "dict.txt"


def find_dictionary(load: str, given: Optional[str]) -> str:
    """--fairseq-dict, else the dict.txt beside the checkpoint."""
    path = given or os.path.join(load if os.path.isdir(load) else os.path.dirname(load) or ".", DICT)
    if not os.path.isfile(path):
        raise FairseqError(f"no fairseq dictionary at {path}; pass --fairseq-dict DICT "
                           f"(the model's dict.txt)")
    return path


def read_checked_dictionary(path: str, rows: int):
    """The dictionary's symbols, checked to be GPT-2 BPE and to match the embedding's rows."""
    try:
        symbols = read_dictionary(path)
        gpt2_ids(symbols, path)
    except DictionaryError as err:
        raise FairseqError(str(err)) from None
    if len(symbols) != rows:
        raise FairseqError(f"{path} gives {len(symbols)} symbols (4 specials + {len(symbols) - 4} "
                           f"lines) but the model's embedding has {rows} rows: it is not this "
                           f"model's dictionary")
    return symbols


def _jsonable(state: dict) -> dict:
    """What the way back needs of the original file: its settings and optimizer history."""
    args = state.get("args")
    return {"args": dict(vars(args)) if isinstance(args, argparse.Namespace) else None,
            "cfg": state.get("cfg"), "optimizer_history": state.get("optimizer_history") or []}


def _config_dict(cfg, own: dict, rows: int, state: dict) -> dict:
    """The converted model's config: the tokenizer over its own files (`_own_files`), and
    the "fairseq" entry for the way back."""
    config = Config(model=cfg)
    d = config.data
    d.tokenizer_type = "FairseqGPT2BPETokenizer"
    d.tokenizer_model, d.vocab_file, d.merge_file = (own.get(name) for name in (
        "tokenizer_model", "vocab_file", "merge_file"))
    out = config.to_dict()
    out["fairseq"] = {**_jsonable(state), "vocab_rows": rows, "dictionary": own["tokenizer_model"]}
    return out


def _own_files(save: str, dict_path: str, vocab_file, merge_file) -> dict:
    """Copies of the dictionary and the GPT-2 BPE files given in <save>/fairseq/: their
    tokenizer fields and names relative to the checkpoint (portable.py)."""
    os.makedirs(os.path.join(save, FAIRSEQ_DIR), exist_ok=True)
    files = {}
    for name, path in (("tokenizer_model", dict_path), ("vocab_file", vocab_file),
                       ("merge_file", merge_file)):
        if path:
            relative = os.path.join(FAIRSEQ_DIR, DICT if name == "tokenizer_model"
                                    else os.path.basename(path))
            shutil.copyfile(path, os.path.join(save, relative))
            files[name] = relative
    return files


def fairseq_to_megatron(load: str, save: str, tp: int = 1, pp: int = 1, dict_path=None,
                        vocab_file=None, merge_file=None, seq_length=None,
                        vocab: VocabOptions = VocabOptions()) -> str:
    """Convert the fairseq checkpoint `load` (file, partitions or directory) under `save`."""
    if os.path.exists(os.path.join(save, TRACKER)):
        raise FairseqError(f"--save {save} already holds a checkpoint; choose a new directory")
    sd, state, _ = files.read_checkpoint(load)
    args = files.model_args(state)
    rows = c.take(sd, mapping.D + "embed_tokens.weight").shape[0]
    dict_path = find_dictionary(load, dict_path)
    read_checked_dictionary(dict_path, rows)
    fields = mapping.model_fields(args, sd, seq_length)
    flat = mapping.to_megatron(sd, build_config(fields, 1, VocabOptions(1), 1))
    cfg = build_config(fields, rows, vocab, tp)
    check_target_layout(cfg, tp, pp)
    for name in (c.WORD, c.OUTPUT):
        if name in flat:
            flat[name] = pad_rows(flat[name], cfg.padded_vocab_size)
    sharding = sharding_for(cfg, flat)
    try:
        own = _own_files(save, dict_path, vocab_file, merge_file)
        write_release(save, flat, _config_dict(cfg, own, rows, state), sharding, tp, pp)
    except BaseException:
        shutil.rmtree(os.path.join(save, FAIRSEQ_DIR), ignore_errors=True)
        raise
    return os.path.join(save, "release")


def megatron_to_fairseq(load: str, save: str) -> str:
    """Write <save>/model.pt and <save>/dict.txt from a checkpoint converted from fairseq."""
    full, stored = read_full_model(load)
    entry = stored.get("fairseq")
    if not entry:
        raise FairseqError(f"{load} was not converted from fairseq (its config has no fairseq "
                           f"settings); only such checkpoints convert back")
    cfg = Config.from_dict(stored).model
    rows = entry["vocab_rows"]
    flat = TrackedTensors({n: t[:rows] if n in (c.WORD, c.OUTPUT) else t
                           for n, t in full.items()})
    model = mapping.to_fairseq(flat, cfg)
    flat.refuse_unused("fairseq's transformer_lm", FairseqError)
    args = argparse.Namespace(**entry["args"]) if entry.get("args") else None
    state = {"args": args, "cfg": entry.get("cfg"), "model": model,
             "optimizer_history": entry.get("optimizer_history") or [],
             "extra_state": {}, "last_optimizer_state": None}
    os.makedirs(save, exist_ok=True)
    path = os.path.join(save, "model.pt")
    files.write_checkpoint(path, state)
    dictionary = entry["dictionary"]  # resolved against the checkpoint (portable.py)
    if not os.path.isfile(dictionary):
        raise FairseqError(f"{load}: the fairseq dictionary {dictionary} is missing; the "
                           f"checkpoint is incomplete (it keeps its copy in {FAIRSEQ_DIR}/{DICT})")
    shutil.copyfile(dictionary, os.path.join(save, DICT))
    return path
