"""Set-up shared by the entry points that load a checkpoint (training resume, sampling, tasks):
the entry-point layer, beside megatron/arguments.py, whose problems exit 2 with one line.

A checkpoint stores its `Config`; model and tokenizer flags left off the command
line are taken from it (flags given explicitly win), so
`--load CKPT --tokenizer-type ...` is enough to rebuild the model. The padded
vocabulary is the checkpoint's (its embedding has that many rows), which keeps
re-sharded checkpoints loadable.
"""
import argparse
import math
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.arguments import (build_parser, config_from_namespace, fail, parse_args,
                                world_size_from_env)
from megatron.compat import apply_compat, explicit_dests
from megatron.config import ConfigError
from megatron.config.model import ARCHITECTURE_FIELDS, RUN_TIME_FIELDS, SCALING_FIELDS
from megatron.model import GPTModel
from megatron.tokenizer import build_tokenizer, padded_vocab_size
from megatron.checkpointing import api
from megatron.checkpointing.formats import RunState
from megatron.checkpointing.io import CheckpointError
from megatron.checkpointing.model_file import tokenizer_file_digests
from megatron.checkpointing.portable import resolve_stored_paths
from megatron.training.parallelize import build_model

REQUIRED_MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads",
                        "max_position_embeddings")
TOKENIZER_FIELDS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_name_or_path",
                    "vocab_size", "tokenizer_model")


def read_stored_config(root: str) -> Dict[str, Any]:
    """The `Config.to_dict()` a checkpoint was saved with ({} when it has none)."""
    found = api.found_or_error(root)
    state = found.format.stored_state(found)
    config = state.get("config") or {}
    config = resolve_stored_paths(dict(config), found.root) if isinstance(config, dict) else {}
    if isinstance(state.get("tokenizer_files"), dict):
        config["tokenizer_files"] = state["tokenizer_files"]
    return config


def model_from_flags(argv: List[str], prog: str) -> Optional[Dict[str, Any]]:
    """The ModelConfig fields of the Megatron flags a tool is given beside its own (as
    Megatron-LM's tools are: --num-layers, --hidden-size, ..., and layout or tokenizer
    flags, which are checked and not needed), for a checkpoint that stores no configuration;
    None without model flags. A flag that is no training flag, or an incomplete or invalid
    model, exits 2 with one line."""
    parser = build_parser(f"{prog} (Megatron flags)")
    parser.set_defaults(**{"training.train_iters": 1, "optimizer.lr": 1.0})
    ns = parser.parse_args(argv)
    given = [n for n in REQUIRED_MODEL_FLAGS if getattr(ns, f"model.{n}") is not None]
    if not given:
        return None
    if len(given) < len(REQUIRED_MODEL_FLAGS):
        fail("the model flags need " + " ".join(f"--{n.replace('_', '-')}" for n in
                                                REQUIRED_MODEL_FLAGS if n not in given), prog)
    if getattr(ns, "model.seq_length") is None:
        setattr(ns, "model.seq_length", getattr(ns, "model.max_position_embeddings"))
    try:
        apply_compat(ns, parser, argv, 1)
        model = config_from_namespace(ns).to_dict()["model"]
    except (ConfigError, TypeError) as err:
        fail(str(err).splitlines()[0], prog)
    return {name: value for name, value in model.items() if value is not None}


def stored_defaults(parser: argparse.ArgumentParser, argv: Optional[List[str]]) -> Dict[str, Any]:
    """With --load (or --finetune) of an existing checkpoint: its stored config, whose model
    and tokenizer fields become the parser's defaults (flags given still win, and
    `check_model_matches` refuses those that contradict it). {} without a checkpoint."""
    known, _ = parser.parse_known_args(argv)
    root = getattr(known, "checkpoint.load", None)
    try:
        if not root or api.detect(root) is None:
            return {}
        stored = read_stored_config(root)
    except (CheckpointError, OSError, RuntimeError) as err:
        fail(str(err).splitlines()[0])
    parser.set_defaults(**checkpoint_defaults(parser, stored))
    return stored


def checkpoint_defaults(parser: argparse.ArgumentParser, stored: Dict[str, Any]) -> Dict[str, Any]:
    """Parser defaults (dest -> value) for every model and tokenizer flag the checkpoint knows."""
    model, data = stored.get("model", {}), stored.get("data", {})
    moe = model.get("moe") or stored.get("moe") or {}  # before it moved into the model: top level
    defaults = {}
    for action in parser._actions:  # argparse has no public list of destinations
        section, _, name = action.dest.partition(".")
        if (section == "model" and name in model and model[name] is not None
                and name not in RUN_TIME_FIELDS):
            defaults[action.dest] = model[name]
        elif section == "moe" and moe.get(name) is not None:
            defaults[action.dest] = moe[name]
        elif section == "data" and name in TOKENIZER_FIELDS and data.get(name) is not None:
            defaults[action.dest] = data[name]
    return defaults


def saved_layout(root: str) -> Tuple[int, int]:
    """(TP, PP) the latest checkpoint under `root` was saved at ((1, 1) when it does not say)."""
    parallel = api.stored_state(root).get("parallel") or {}
    return (int(parallel.get("tensor_model_parallel_size", 1)),
            int(parallel.get("pipeline_model_parallel_size", 1)))


def inference_layout(saved: Tuple[int, int], world: int, given_tp: Optional[int],
                     given_pp: Optional[int], one_stage: bool) -> Tuple[int, int]:
    """(TP, PP) to run a checkpoint saved at `saved` on `world` processes: the flags given
    win; otherwise the checkpoint's layout when it fits the world size (one stage for tools
    that need one), else the largest TP dividing both at one stage. The weights are
    re-sharded in memory when this differs from the saved layout."""
    tp = given_tp or saved[0]
    pp = given_pp or (1 if one_stage else saved[1])
    if world % (tp * pp) == 0:
        return tp, pp
    return (given_tp or math.gcd(saved[0], world)), (given_pp or 1)


def _layout_from_checkpoint(ns, parser, argv, root: str, one_stage: bool) -> None:
    explicit = explicit_dests(parser, sys.argv[1:] if argv is None else argv)
    if "training.train_iters" not in explicit and getattr(ns, "training.train_samples"):
        setattr(ns, "training.train_iters", None)  # training's GPT_ARGS, reused as they are
    given = [getattr(ns, dest) if dest in explicit else None for dest in
             ("parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size")]
    tp, pp = inference_layout(saved_layout(root), world_size_from_env(), *given, one_stage)
    setattr(ns, "parallel.tensor_model_parallel_size", tp)
    setattr(ns, "parallel.pipeline_model_parallel_size", pp)


def parse_inference_args(parser: argparse.ArgumentParser, argv: Optional[List[str]] = None,
                         one_stage: bool = False):
    """Parse flags, filling model and tokenizer flags, and the TP / PP layout (see
    `inference_layout`; `one_stage` for tools that run whole models) from the checkpoint
    in --load.

    Returns (config, namespace, stored_config). Problems exit 2 with one line.
    """
    parser.set_defaults(**{"training.train_iters": 1, "optimizer.lr": 1.0})
    known, _ = parser.parse_known_args(argv)
    root = getattr(known, "checkpoint.load", None)
    if not root:
        fail("--load is required: the checkpoint directory (the --save of a training run)")
    try:
        stored = read_stored_config(root)
    except (CheckpointError, OSError, RuntimeError) as err:
        fail(str(err).splitlines()[0])
    parser.set_defaults(**checkpoint_defaults(parser, stored))

    def complete(ns):
        _layout_from_checkpoint(ns, parser, argv, root, one_stage)
        missing = [f"--{n.replace('_', '-')}" for n in REQUIRED_MODEL_FLAGS
                   if getattr(ns, f"model.{n}", None) is None]
        if missing:
            raise ConfigError(f"missing {' '.join(missing)}: the checkpoint in {root} stores "
                              f"no model config; pass them")
        if getattr(ns, "model.seq_length", None) is None:
            setattr(ns, "model.seq_length", getattr(ns, "model.max_position_embeddings"))
        _default_global_batch(ns)

    config, ns = parse_args(argv, parser, complete=complete)
    config.parallel.sequence_parallel = False
    # Inference runs whole sequences on every rank: context-parallel ranks (a training
    # run's --context-parallel-size, reused) become more data-parallel ranks.
    config.parallel.context_parallel_size = 1
    return config, ns, stored


def _default_global_batch(ns) -> None:
    """Inference has no global batch; make the interleaved schedule's check pass by default."""
    if getattr(ns, "training.global_batch_size", None) is not None:
        return
    tp = getattr(ns, "parallel.tensor_model_parallel_size")
    pp = getattr(ns, "parallel.pipeline_model_parallel_size")
    dp = max(1, world_size_from_env() // (tp * pp))
    setattr(ns, "training.global_batch_size", getattr(ns, "training.micro_batch_size") * dp * pp)


MAX_PADDING_TP = 64  # padding adds < divisible-by x TP rows; no TP size beyond this is assumed
# Tokenizer types that only name a reader of the user's tokenizer files: one LLaMA-2
# tokenizer.model can be read as Llama2Tokenizer or through its Hugging Face directory.
# Switching among them is allowed (the vocabulary size is still checked).
_FILE_TOKENIZERS = {"PretrainedFromHF", "HuggingFaceTokenizer", "SentencePieceTokenizer",
                    "GPTSentencePieceTokenizer", "Llama2Tokenizer", "Llama3Tokenizer"}


# Fields whose flag is not --<field-name>.
_FLAG_OF = {"activation": "--swiglu/--glu-activation/--openai-gelu/--exact-gelu/--squared-relu",
            "add_bias_linear": "--disable-bias-linear", "layernorm_epsilon": "--norm-epsilon"}


def _tokenizer_kind(name: str) -> str:
    return "tokenizer files" if name in _FILE_TOKENIZERS else name


def check_model_matches(config, stored: Dict[str, Any]) -> None:
    """The model and tokenizer the flags describe are the checkpoint's (exit 2 naming both)."""
    model, data = stored.get("model") or {}, stored.get("data") or {}
    root = config.checkpoint.load
    scaling = SCALING_FIELDS.get(model.get("rope_scaling_type"), ())
    names = tuple(n for n in ARCHITECTURE_FIELDS + scaling if n in model)
    if config.model.position_embedding_type == "learned_absolute":
        names += ("max_position_embeddings",)
    for name in names:
        saved, given = model.get(name), getattr(config.model, name)
        if saved is not None and saved != given:
            flag = _FLAG_OF.get(name)
            shown = (f"{flag} {given}" if flag and flag.count("--") == 1 else
                     f"{name} {given} ({flag})" if flag else f"--{name.replace('_', '-')} {given}")
            fail(f"{shown} does not match the checkpoint in {root}, "
                 f"which was saved with {saved}; use the checkpoint's model flags")
    saved, given = data.get("tokenizer_type"), config.data.tokenizer_type
    if saved is not None and given is not None and _tokenizer_kind(saved) != _tokenizer_kind(given):
        fail(f"--tokenizer-type {given} does not match the checkpoint in {root}, which was "
             f"trained with {saved}; use the tokenizer the model was trained with")


def check_tokenizer_files(config, stored: Dict[str, Any], vocab_size: int) -> None:
    """The tokenizer files given have the content of those the checkpoint was trained with
    (same tokenizer type, other files: another vocabulary under the same ids)."""
    saved = stored.get("tokenizer_files") or {}
    given = tokenizer_file_digests(config.data)
    rows = stored.get("model", {}).get("padded_vocab_size")
    for name, digest in given.items():
        if name in saved and saved[name] != digest:
            fail(f"--{name.replace('_', '-')} {getattr(config.data, name)} (sha256 {digest[:12]}, "
                 f"{vocab_size} ids) is not the one the checkpoint in {config.checkpoint.load} "
                 f"was trained with (sha256 {saved[name][:12]}, an embedding of {rows} rows); "
                 f"use the model's tokenizer files")


def build_tokenizer_and_vocab(config, stored: Dict[str, Any]):
    """Tokenizer from the (merged) flags; sets config.model.padded_vocab_size.

    The checkpoint's padded size wins when it is stored: the embedding has that
    many rows. It must cover the tokenizer and divide by the TP size.
    """
    check_model_matches(config, stored)
    d, tp = config.data, config.parallel.tensor_model_parallel_size
    if d.tokenizer_type is None:
        fail("--tokenizer-type is required (the checkpoint stores none), e.g. GPT2BPETokenizer "
             "with --vocab-file and --merge-file")
    try:
        tokenizer = build_tokenizer(d.tokenizer_type, d.vocab_file, d.merge_file,
                                    d.tokenizer_name_or_path, d.vocab_size, d.tokenizer_model)
    except (ValueError, OSError, ImportError) as err:
        fail(str(err).splitlines()[0])
    saved = stored.get("model", {}).get("padded_vocab_size") or 0
    if saved:
        if saved < tokenizer.vocab_size:
            fail(f"the checkpoint's vocabulary has {saved} rows but the tokenizer has "
                 f"{tokenizer.vocab_size} ids; use the tokenizer the model was trained with")
        unit = stored["model"].get("make_vocab_size_divisible_by") or config.model.make_vocab_size_divisible_by
        if saved - tokenizer.vocab_size >= unit * MAX_PADDING_TP:
            fail(f"the checkpoint's vocabulary has {saved} rows, far more than the tokenizer's "
                 f"{tokenizer.vocab_size} ids (padding adds fewer than --make-vocab-size-divisible-by "
                 f"{unit} x TP); use the tokenizer the model was trained with")
        if saved % tp:
            fail(f"the checkpoint's padded vocabulary ({saved}) is not divisible by "
                 f"--tensor-model-parallel-size {tp}")
        config.model.padded_vocab_size = saved
        check_tokenizer_files(config, stored, tokenizer.vocab_size)
    else:
        try:
            config.model.padded_vocab_size = padded_vocab_size(
                tokenizer.vocab_size, config.model.make_vocab_size_divisible_by, tp,
                config.model.pad_vocab_size_to)
        except ValueError as err:
            fail(str(err))
    return tokenizer


def load_inference_models(config, pstate, device, parallel_output: bool = True,
                          vocab_size: Optional[int] = None) -> Tuple[List[torch.nn.Module], int]:
    """This rank's model chunks with the checkpoint's weights, in eval mode; and its iteration
    (re-sharded in memory when it was saved at another layout).

    `vocab_size`: the tokenizer's; the padding rows beyond it get -inf logits."""
    def provider(cfg, **chunk):
        return GPTModel(cfg, tp_group=pstate.tp_group, parallel_output=parallel_output,
                        vocab_limit=vocab_size, expert_groups=pstate.expert_groups(), **chunk)

    models = build_model(config, pstate, device, provider)
    root = config.checkpoint.load
    if pstate.rank == 0:
        print("\n".join(api.loading_lines(api.found_or_error(root))), flush=True)
    iteration, _, _ = api.load(root, RunState(models, config, pstate), inference=True)
    for model in models:
        model.eval()
    if pstate.rank == 0:
        print(f"  successfully loaded checkpoint from {root} at iteration {iteration}",
              flush=True)
    return models, iteration
