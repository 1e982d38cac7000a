"""Hugging Face directory <-> our checkpoint, at any target TP / PP.

HF -> ours: the architecture's mapping builds the full (TP = 1) state dict in
our names and row layouts, the vocabulary is padded with rows of zeros, the
result is checked against the model our ModelConfig builds (names, shapes) and
written as a `release` checkpoint (what --load and --finetune accept) with the
config, the sharding metadata and an "hf" entry in the config (architecture,
the HF config, the real vocabulary rows), then re-sharded
(reshard.py). The HF directory's other files (tokenizer...) are
copied to <save>/hf_files.

ours -> HF: the checkpoint is merged to full tensors, the padding rows dropped
and the layouts undone; the stored HF config is written back unchanged. A
checkpoint without it (trained here) is exported as the architecture its
position encoding implies (GPT-2, LLaMA, BLOOM) if that expresses every
architecture field of its config, keeping its tokenizer's vocabulary rows.
"""
import copy
import json
import os
from dataclasses import dataclass
from typing import Optional

from megatron.checkpointing import api
from megatron.checkpointing.formats import Target
from megatron.checkpointing.hf import ConversionError
from megatron.checkpointing.hf.common import OUTPUT, WORD
from megatron.checkpointing.hf.families import FAMILIES, family_of, hf_config_for
from megatron.checkpointing.hf.hf_files import (copy_other_files, other_files, read_config,
                                                read_weights, write_hf_dir)
from megatron.checkpointing.hf.layouts import pad_rows
from megatron.checkpointing.portable import resolve_stored_paths
from megatron.checkpointing.tracker import TRACKER
from megatron.config import Config, ConfigError, ModelConfig
from megatron.model import GPTModel
from megatron.tokenizer import build_tokenizer, padded_vocab_size

HF_FILES = "hf_files"  # portable.FILES_DIR
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass
class VocabOptions:
    make_vocab_size_divisible_by: int = 128
    pad_vocab_size_to: Optional[int] = None


def padded_rows(rows: int, opts: VocabOptions, tp: int) -> int:
    """Rows of the padded vocabulary: --pad-vocab-size-to, else the usual multiple."""
    target = opts.pad_vocab_size_to
    if target is None:
        return padded_vocab_size(rows, opts.make_vocab_size_divisible_by, tp)
    if target < rows:
        raise ConversionError(f"the model's vocabulary ({rows} rows) does not fit in "
                              f"--pad-vocab-size-to {target}")
    if target % tp:
        raise ConversionError(f"--pad-vocab-size-to {target} is not divisible by "
                              f"--target-tensor-model-parallel-size {tp}")
    return target


def check_tokenizer_fits(directory: str, rows: int) -> None:
    """A tokenizer shipped with the model must not produce ids past the embedding."""
    if not any(os.path.isfile(os.path.join(directory, n)) for n in TOKENIZER_FILES):
        return
    try:
        from transformers import AutoTokenizer
        size = len(AutoTokenizer.from_pretrained(directory, local_files_only=True))
    except (ImportError, OSError, ValueError, KeyError):  # unreadable: the user's to fix on use
        return
    if size > rows:
        raise ConversionError(f"the tokenizer in {directory} has {size} ids but the model's "
                              f"vocabulary only {rows} rows: the vocabulary does not fit")


def build_config(fields: dict, rows: int, opts: VocabOptions, tp: int) -> ModelConfig:
    try:
        return ModelConfig(**fields, padded_vocab_size=padded_rows(rows, opts, tp),
                           make_vocab_size_divisible_by=opts.make_vocab_size_divisible_by,
                           pad_vocab_size_to=opts.pad_vocab_size_to)
    except ConfigError as err:
        raise ConversionError(f"the converted model is invalid: {err}") from None


def sharding_for(cfg: ModelConfig, flat: dict) -> dict:
    """Sharding metadata of the model `cfg` builds, after checking `flat` fits it exactly."""
    model = GPTModel(cfg, device="meta")
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    got = {name: tuple(t.shape) for name, t in flat.items()}
    for name in sorted(set(expected) | set(got)):
        if expected.get(name) != got.get(name):
            raise ConversionError(f"converted tensor {name} has shape {got.get(name)} but the "
                                  f"model built from its config expects {expected.get(name)}")
    return model.sharding_metadata()


def write_release(root: str, flat: dict, config: dict, sharding: dict, tp: int = 1,
                  pp: int = 1) -> str:
    """A converted model as a `release` checkpoint (model only) at TP `tp` x PP `pp`, with the
    tracker; returns its directory."""
    stored = {"iteration": 0, "release": True, "config": config, "sharding": sharding,
              "consumed_train_samples": 0, "consumed_valid_samples": 0}
    return api.write_model(root, flat, stored, "torch", Target(tp, pp))


def check_target_layout(cfg: ModelConfig, tp: int, pp: int) -> None:
    """The training layout rules (heads, query groups, layers, ffn) for TP `tp` x PP `pp`."""
    config = Config(model=cfg)
    config.parallel.tensor_model_parallel_size = tp
    config.parallel.pipeline_model_parallel_size = pp
    try:
        config.check_layout(tp * pp)
    except ConfigError as err:
        raise ConversionError(f"the model does not fit TP {tp} x PP {pp}: {err}") from None


def generation_config(load: Optional[str], hf: dict) -> dict:
    """The HF directory `load`'s generation_config.json, else the one transformers derives
    from the model config (its bos / eos / pad ids)."""
    path = os.path.join(load, GENERATION_CONFIG) if load else None
    if path and os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    ids = {name: hf[name] for name in ("bos_token_id", "eos_token_id", "pad_token_id")
           if hf.get(name) is not None}
    return {"_from_model_config": True, **ids}


def _config_dict(cfg: ModelConfig, arch: str, hf: dict, rows: int, load: str, files_dir) -> dict:
    """Our config as a dict, with an "hf" entry that the way back needs. The tokenizer files
    are referenced relative to the checkpoint (`files_dir`: a name inside it)."""
    config = Config(model=cfg)
    if files_dir and any(os.path.isfile(os.path.join(load, n)) for n in TOKENIZER_FILES):
        config.data.tokenizer_type = "PretrainedFromHF"
        config.data.tokenizer_name_or_path = files_dir
    config.hf = {"architecture": arch, "config": hf, "vocab_rows": rows, "files_dir": files_dir,
                 "generation_config": generation_config(load, hf)}
    return config.to_dict()


def hf_to_megatron(load: str, save: str, tp: int = 1, pp: int = 1,
                   seq_length: Optional[int] = None, vocab: VocabOptions = VocabOptions()) -> str:
    """Convert the HF directory `load` to a checkpoint under `save` at TP `tp` x PP `pp`."""
    if os.path.exists(os.path.join(save, TRACKER)):
        raise ConversionError(f"--save {save} already holds a checkpoint; choose a new directory")
    hf = read_config(load)
    arch, family = family_of(hf)
    if hasattr(family, "text_part"):  # a multimodal architecture: its text model (gemma3)
        arch, hf, note = family.text_part(arch, hf)
        if note:
            print(f" {note}", flush=True)
    weights = read_weights(load)
    if hasattr(family, "prepare"):  # what the files hold decides (deepseek_v3: FP8, MTP)
        hf, weights = family.prepare(hf, weights)
    fields = family.model_fields(hf, seq_length)
    flat = family.to_megatron(weights, hf, build_config(fields, 1, VocabOptions(1), 1))
    rows = flat[WORD].shape[0]
    check_tokenizer_fits(load, rows)
    cfg = build_config(fields, rows, vocab, tp)
    check_target_layout(cfg, tp, pp)
    for name in (WORD, OUTPUT):
        if name in flat:
            flat[name] = pad_rows(flat[name], cfg.padded_vocab_size)
    sharding = sharding_for(cfg, flat)
    files_dir = HF_FILES if other_files(load) else None
    config = _config_dict(cfg, arch, hf, rows, load, files_dir)
    directory = write_release(save, flat, config, sharding, tp, pp)
    if files_dir:
        copy_other_files(load, os.path.join(save, files_dir))
    return directory


def read_full_model(load: str, model: Optional[dict] = None):
    """(full TP = 1 tensors with global layer numbers, stored config dict) of a checkpoint
    of any format (ours or Megatron-Core's; `model`: api.read_model's)."""
    full, stored = api.read_model(load, model)
    root = api.found_or_error(load).root
    return full, resolve_stored_paths(copy.deepcopy(stored["config"]), root)


class TrackedTensors(dict):
    """A state dict that remembers which tensors an export read, so that one it could not
    carry is refused rather than dropped (`refuse_unused`)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.used = set()

    def __getitem__(self, name):
        self.used.add(name)
        return super().__getitem__(name)

    def refuse_unused(self, target: str, error=ConversionError) -> None:
        """One line naming a tensor that the export to `target` did not read."""
        unused = sorted(set(self) - self.used)
        if unused:
            raise error(f"{len(unused)} tensors have no counterpart in {target}, e.g. "
                        f"{unused[0]}: {target} cannot carry them; keep the model as a torch "
                        f"or torch_dist checkpoint, which hold every tensor")


def _tokenizer_size(data, load: str) -> int:
    """Ids of the tokenizer a checkpoint was trained with (its stored tokenizer flags)."""
    if data.tokenizer_type is None:
        raise ConversionError(f"{load} stores no tokenizer; give --hf-vocab-size (the real "
                              f"vocabulary size, without padding)")
    try:
        return build_tokenizer(data.tokenizer_type, data.vocab_file, data.merge_file,
                               data.tokenizer_name_or_path, data.vocab_size).vocab_size
    except (ValueError, OSError, ImportError) as err:
        raise ConversionError(f"cannot build the checkpoint's tokenizer ({err}); give "
                              f"--hf-vocab-size") from None


def hf_target(stored: dict, load: str, vocab_size: Optional[int] = None):
    """(architecture, HF config, real vocabulary rows, directory of other files to copy):
    the stored "hf" entry of a converted checkpoint, else derived from our config."""
    entry = stored.get("hf")
    if entry:
        hf = dict(entry["config"])
        if not hf.get("architectures"):
            hf["architectures"] = [entry["architecture"]]
        return entry["architecture"], hf, entry["vocab_rows"], entry.get("files_dir")
    config = Config.from_dict(stored)
    rows = vocab_size or _tokenizer_size(config.data, load)
    if rows > config.model.padded_vocab_size:
        raise ConversionError(f"--hf-vocab-size {rows} exceeds the checkpoint's "
                              f"{config.model.padded_vocab_size} vocabulary rows")
    arch, hf = hf_config_for(config.model, rows)
    hf_tokenizer = config.data.tokenizer_type == "PretrainedFromHF"
    return arch, hf, rows, config.data.tokenizer_name_or_path if hf_tokenizer else None


def megatron_to_hf(load: str, save: str, vocab_size: Optional[int] = None,
                   model: Optional[dict] = None) -> str:
    """Convert the latest checkpoint under `load` to an HF directory. A checkpoint converted
    from HF gets its HF config back; another one an HF config derived from its own, with
    `vocab_size` (default: its tokenizer's) rows. `model`: the model flags of a checkpoint
    that stores no configuration (api.read_model)."""
    full, stored = read_full_model(load, model)
    arch, hf, rows, files_dir = hf_target(stored, load, vocab_size)
    cfg = Config.from_dict(stored).model
    flat = TrackedTensors({name: t[:rows] if name in (WORD, OUTPUT) else t
                           for name, t in full.items()})
    weights = FAMILIES[arch].to_hf(flat, hf, cfg)
    flat.refuse_unused(f"Hugging Face's {arch}")
    generation = (stored.get("hf") or {}).get("generation_config") or generation_config(None, hf)
    write_hf_dir(save, hf, weights, files_dir, {GENERATION_CONFIG: generation})
    return save
