"""Megatron-LM and Megatron-DeepSpeed spellings mapped onto our flags, before the Config is built.

Most compatible names are plain aliases declared in megatron/arguments.py; what needs
more than an alias (a value mapping, a DeepSpeed JSON, a unit conversion, a fallback
with a notice) happens here, on the parsed namespace.
"""
import os

from megatron.config import ConfigError
from megatron.data.weighted_split import parse_weighted_split_groups
from megatron.deepspeed_config import apply_deepspeed

ATTENTION_BACKENDS = {"auto": "auto", "flash": "sdpa", "fused": "fused", "unfused": "torch",
                      "local": "torch"}


def notice(message: str) -> None:
    """One line on stdout, from the first rank only."""
    if os.environ.get("RANK", "0") == "0":
        print(f" > {message}", flush=True)


def explicit_dests(parser, argv) -> set:
    """Namespace dests of the flags written on the command line."""
    by_option = {o: a.dest for a in parser._actions for o in a.option_strings}  # no public map
    return {by_option[tok.split("=", 1)[0]] for tok in argv
            if tok.startswith("--") and tok.split("=", 1)[0] in by_option}


def apply_compat(ns, parser, argv, world_size: int) -> None:
    """Rewrite the compatibility flags of `ns` into our own; raises ConfigError."""
    _data_impl(getattr(ns, "compat.data_impl", None))
    for split in ("train", "valid", "test"):
        groups = getattr(ns, f"data.{split}_weighted_split_paths", None)
        if groups:
            parse_weighted_split_groups(f"--{split}-weighted-split-paths", groups)
    backend = getattr(ns, "compat.attention_backend", None)
    if backend is not None:
        setattr(ns, "model.attention_impl", ATTENTION_BACKENDS[backend])
    apply_deepspeed(ns, explicit_dests(parser, argv), world_size, notice)
    _train_tokens(ns)
    _lr_decay_tokens(ns)
    _ddp_impl_fallback(ns)
    _no_position_embedding(ns)


def _data_impl(value) -> None:
    if value in ("lazy", "cached"):
        raise ConfigError(f"--data-impl {value} is not supported: mmap is the only format; "
                          f"re-run tools/preprocess_data.py on the corpus (it writes mmap files)")


def _train_tokens(ns) -> None:
    """--train-tokens caps the run: train samples = ceil(tokens / seq length)."""
    tokens = getattr(ns, "training.train_tokens", None)
    seq = getattr(ns, "model.seq_length", None)
    if tokens is None or seq is None:
        return
    samples = -(-tokens // seq)
    iters, given = getattr(ns, "training.train_iters"), getattr(ns, "training.train_samples")
    if iters is None:
        setattr(ns, "training.train_samples", samples if given is None else min(given, samples))
        return
    gbs = getattr(ns, "training.global_batch_size")
    if gbs is None or getattr(ns, "training.rampup_batch_size") is not None or \
            getattr(ns, "training.step_batch_size_schedule") is not None:
        raise ConfigError("--train-tokens with --train-iters needs a fixed --global-batch-size "
                          "(or use --train-samples)")
    setattr(ns, "training.train_iters", min(iters, -(-samples // gbs)))


def _lr_decay_tokens(ns) -> None:
    tokens = getattr(ns, "optimizer.lr_decay_tokens", None)
    seq = getattr(ns, "model.seq_length", None)
    if tokens is not None and seq is not None:
        setattr(ns, "optimizer.lr_decay_samples_from_tokens", tokens / seq)


def _no_position_embedding(ns) -> None:
    """Megatron-LM's --no-position-embedding drops the learned absolute positions; with
    --position-embedding-type rope (its Mixtral script) there are none anyway."""
    if getattr(ns, "compat.no_position_embedding", False) and \
            getattr(ns, "model.position_embedding_type", None) in (None, "learned_absolute"):
        setattr(ns, "model.position_embedding_type", "none")


def _ddp_impl_fallback(ns) -> None:
    """--DDP-impl torch cannot drive pipelined chunks; fall back to local with a notice."""
    if getattr(ns, "parallel.DDP_impl") == "torch" and \
            getattr(ns, "parallel.pipeline_model_parallel_size") > 1:
        setattr(ns, "parallel.DDP_impl", "local")
        notice("--DDP-impl torch runs the whole model in one DistributedDataParallel forward, "
               "which pipeline stages do not have; using --DDP-impl local (same gradients)")
