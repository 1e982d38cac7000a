"""fairseq checkpoint (+ dict.txt) <-> our checkpoint at any TP / PP.

fairseq -> ours: the file or partitions are read and merged, the settings mapped
(mapping.model_fields), the dictionary read and checked against the embedding rows,
the vocabulary padded with zero rows (their logits are masked to -inf through the
tokenizer's size) and the result written as a `release` checkpoint, re-sharded to
the target layout. The rows keep fairseq's dictionary order: the checkpoint's
tokenizer is FairseqGPT2BPETokenizer over a copy of dict.txt (<save>/fairseq/dict.txt),
which maps GPT-2 ids to those rows. The config keeps a "fairseq" entry (the original
cfg / args, the dictionary) for the way back.

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
from megatron.checkpointing.tracker import TRACKER
from megatron.config import Config
from megatron.tokenizer.fairseq_dict import DictionaryError, gpt2_ids, read_dictionary

FAIRSEQ_DIR = "fairseq"
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


def _config_dict(cfg, dict_copy: str, rows: int, state: dict, vocab_file, merge_file) -> dict:
    config = Config(model=cfg)
    d = config.data
    d.tokenizer_type, d.tokenizer_model = "FairseqGPT2BPETokenizer", dict_copy
    d.vocab_file = os.path.abspath(vocab_file) if vocab_file else None
    d.merge_file = os.path.abspath(merge_file) if merge_file else None
    out = config.to_dict()
    out["fairseq"] = {**_jsonable(state), "vocab_rows": rows, "dictionary": dict_copy}
    return out


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
    dict_copy = os.path.join(os.path.abspath(save), FAIRSEQ_DIR, DICT)
    config = _config_dict(cfg, dict_copy, rows, state, vocab_file, merge_file)
    write_release(save, flat, config, sharding, tp, pp)
    os.makedirs(os.path.dirname(dict_copy), exist_ok=True)
    shutil.copyfile(dict_path, dict_copy)
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
    dictionary = entry["dictionary"]
    if not os.path.isfile(dictionary):  # the checkpoint was moved: its own copy
        dictionary = os.path.join(load, FAIRSEQ_DIR, DICT)
    shutil.copyfile(dictionary, os.path.join(save, DICT))
    return path
