"""DeepSpeed launch lines without DeepSpeed: the ds_config.json keys become our flags.

`--deepspeed --deepspeed_config ds_config.json --zero-stage N` (and the `deepspeed`
launcher's `--local_rank`) are accepted. The JSON's batch sizes, gradient clipping,
fp16 / bf16 settings and `zero_optimization.stage` fill the flags they correspond to;
ZeRO stage 0 is the regular optimizer, 1 the distributed optimizer (ZeRO-1), 2 the
distributed optimizer with a notice (gradients are not sharded here), 3 an error.
A JSON value that contradicts a flag given on the command line is an error naming both.
"""
import json
from typing import Any, Dict

from megatron.arguments_help import HELP
from megatron.config import ConfigError

# JSON path -> (flag, namespace dest, conversion)
_MAPPED = (
    ("train_micro_batch_size_per_gpu", "--micro-batch-size", "training.micro_batch_size", int),
    ("train_batch_size", "--global-batch-size", "training.global_batch_size", int),
    ("gradient_clipping", "--clip-grad", "optimizer.clip_grad", float),
    ("fp16.enabled", "--fp16", "training.fp16", bool),
    ("fp16.loss_scale", "--loss-scale", "optimizer.loss_scale", lambda v: float(v) or None),
    ("fp16.initial_scale_power", "--initial-loss-scale", "optimizer.initial_loss_scale",
     lambda v: 2.0 ** int(v)),
    ("fp16.loss_scale_window", "--loss-scale-window", "optimizer.loss_scale_window", int),
    ("fp16.hysteresis", "--hysteresis", "optimizer.hysteresis", int),
    ("fp16.min_loss_scale", "--min-loss-scale", "optimizer.min_loss_scale", float),
    ("bf16.enabled", "--bf16", "training.bf16", bool),
)
# Keys read elsewhere or with no effect on the result of training.
_KNOWN = {"gradient_accumulation_steps", "zero_optimization", "steps_per_print",
          "wall_clock_breakdown", "zero_allow_untested_optimizer", "fp16", "bf16",
          "activation_checkpointing", "flops_profiler", "tensorboard", "comms_logger"}


def add_deepspeed_args(group, flag) -> None:
    flag(group, "--deepspeed", "compat", action="store_true")
    group.add_argument("--deepspeed_config", "--deepspeed-config", dest="compat.deepspeed_config",
                       default=None, metavar="JSON", help=HELP["--deepspeed_config"])
    flag(group, "--zero-stage", "compat", type=int, default=None)
    for name in ("--deepspeed-activation-checkpointing", "--partition-activations"):
        flag(group, name, "compat", action="store_true")


def read_deepspeed_config(path: str) -> Dict[str, Any]:
    try:
        with open(path) as f:
            values = json.load(f)
    except OSError as err:
        raise ConfigError(f"--deepspeed_config {path}: {err.strerror}") from None
    except ValueError as err:
        raise ConfigError(f"--deepspeed_config {path} is not valid JSON: {err}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"--deepspeed_config {path}: expected a JSON object")
    return values


def _lookup(values: dict, path: str):
    for key in path.split("."):
        if not isinstance(values, dict) or key not in values:
            return None
        values = values[key]
    return None if values == "auto" else values


def _set(ns, explicit: set, source: str, key: str, raw, flag: str, dest: str, value) -> None:
    current = getattr(ns, dest)
    if dest in explicit and current != value:
        given = flag if current is True else f"{flag} {current}"
        raise ConfigError(f"{source}: {key}={json.dumps(raw)} contradicts {given} on the "
                          f"command line; make them agree")
    setattr(ns, dest, value)


def apply_deepspeed(ns, explicit: set, world_size: int, notice) -> None:
    """Fill `ns` from --deepspeed_config and --zero-stage when --deepspeed is given."""
    if not getattr(ns, "compat.deepspeed"):
        return
    path = getattr(ns, "compat.deepspeed_config")
    values = read_deepspeed_config(path) if path else {}
    source = f"--deepspeed_config {path}"
    for key, flag, dest, convert in _MAPPED:
        raw = _lookup(values, key)
        if raw is not None and not _in_disabled_block(values, key):
            _set(ns, explicit, source, key, raw, flag, dest, convert(raw))
    _accumulation(ns, values, source, world_size)
    _zero_stage(ns, values, source, notice)
    unused = sorted(set(values) - _KNOWN - {k.split(".")[0] for k, *_ in _MAPPED})
    if unused:
        notice(f"{source}: keys not used here: {', '.join(unused)}")


def _in_disabled_block(values: dict, key: str) -> bool:
    """A setting of an fp16 / bf16 block with "enabled": false, which DeepSpeed ignores."""
    block, _, name = key.partition(".")
    return name != "enabled" and _lookup(values, f"{block}.enabled") is False


def _accumulation(ns, values: dict, source: str, world_size: int) -> None:
    """train_batch_size = micro batch x gradient_accumulation_steps x data-parallel size."""
    steps = _lookup(values, "gradient_accumulation_steps")
    if steps is None:
        return
    tp = getattr(ns, "parallel.tensor_model_parallel_size")
    pp = getattr(ns, "parallel.pipeline_model_parallel_size")
    dp = max(1, world_size // (tp * pp))
    implied = getattr(ns, "training.micro_batch_size") * int(steps) * dp
    gbs = getattr(ns, "training.global_batch_size")
    if gbs is None:
        setattr(ns, "training.global_batch_size", implied)
    elif gbs != implied:
        raise ConfigError(f"{source}: gradient_accumulation_steps={steps} gives a global batch of "
                          f"{implied} (micro batch x steps x data-parallel size {dp}), but the "
                          f"global batch size is {gbs}; make them agree")


def _zero_stage(ns, values: dict, source: str, notice) -> None:
    from_json = _lookup(values, "zero_optimization.stage")
    from_flag = getattr(ns, "compat.zero_stage")
    if from_json is not None and from_flag is not None and int(from_json) != from_flag:
        raise ConfigError(f"{source}: zero_optimization.stage={from_json} contradicts "
                          f"--zero-stage {from_flag} on the command line; make them agree")
    stage = int(from_json if from_json is not None else (from_flag or 0))
    if stage >= 3:
        raise ConfigError(f"ZeRO stage {stage} (parameter sharding) is not supported; use stage 1 "
                          f"(the distributed optimizer) with tensor or pipeline parallelism")
    if stage >= 1:
        setattr(ns, "parallel.use_distributed_optimizer", True)
    if stage == 1:
        notice("ZeRO stage 1 runs as --use-distributed-optimizer: optimizer state is sharded "
               "over data-parallel ranks")
    if stage == 2:
        notice("ZeRO stage 2 runs as stage 1 here: optimizer state is sharded over data-parallel "
               "ranks, gradients are all-reduced whole")
