"""The one command-line parser: Megatron-LM's flag names filled into `Config`.

Each flag's dest is "section.field"; `parse_args` groups them into the section
dataclasses, whose validation (and `Config.check_layout`) raises ConfigError.
Entry points turn that into one line on stderr and exit status 2.
"""
import argparse
import os
import re
import signal
import sys
import time
from typing import Callable, List, Optional, Sequence

from megatron.arguments_help import HELP
from megatron.checkpointing.api import saved_formats
from megatron.checkpointing.io import CheckpointError
from megatron.compat import ATTENTION_BACKENDS, apply_compat
from megatron.deepspeed_config import add_deepspeed_args
from megatron.tokenizer import TOKENIZER_TYPES
from megatron.config import SECTIONS, Config, ConfigError, MoEConfig
from megatron.config.model import (GLU_ACTIVATIONS, KERNEL_CHOICES, NORMALIZATIONS,
                                   POSITION_EMBEDDING_TYPES, ROPE_SCALING_TYPES,
                                   SOFTMAX_TYPES)
from megatron.config import moe as moe_choices

class OneLineParser(argparse.ArgumentParser):
    """argparse with two fixes: an error is one line (no usage dump) and exit 2,
    and negative numbers in any notation (`--lr -1e-3`) are values, not flags."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$")

    def error(self, message):
        fail(message, self.prog)


class _JoinWords(argparse.Action):
    """nargs="+" values joined by spaces: a quoted list and the shell's word-split form of it
    (an unquoted `${ARGS[@]}` expansion) are the same value."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, " ".join(values))


def _flag(group, name, section, field=None, **kwargs):
    field = field or name.lstrip("-").replace("-", "_")
    if kwargs.get("action") not in ("store_true", "store_false", "store_const") and "choices" not in kwargs:
        kwargs.setdefault("metavar", field.upper())
    kwargs.setdefault("help", HELP.get(name))
    group.add_argument(name, dest=f"{section}.{field}", **kwargs)


def _off(group, name, section, field):
    """A --no-X switch that turns a default-on feature off."""
    group.add_argument(name, dest=f"{section}.{field}", action="store_false", help=HELP.get(name))


def _add_model_args(parser):
    g = parser.add_argument_group("model")
    for name in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                 "--max-position-embeddings", "--ffn-hidden-size"):
        _flag(g, name, "model", type=int, default=None)
    _flag(g, "--make-vocab-size-divisible-by", "model", type=int, default=128)
    _flag(g, "--layernorm-epsilon", "model", type=float, default=1e-5)
    _flag(g, "--init-method-std", "model", type=float, default=0.02)
    _flag(g, "--hidden-dropout", "model", type=float, default=0.1)
    _flag(g, "--attention-dropout", "model", type=float, default=0.1)
    _flag(g, "--checkpoint-activations", "model", action="store_true",
          help="recompute activations in backward (full granularity)")
    _flag(g, "--checkpoint-num-layers", "model", type=int, default=1)
    _flag(g, "--recompute-granularity", "model", choices=["full", "selective"], default=None)
    _flag(g, "--use-cpu-initialization", "model", action="store_true")
    _flag(g, "--attention-impl", "model", choices=["auto", "sdpa", "fused", "torch"], default="auto")
    _flag(g, "--fused-kernels-choice", "model", choices=list(KERNEL_CHOICES), default=None)
    _flag(g, "--attention-softmax-in-fp32", "model", action="store_true")
    _flag(g, "--apply-query-key-layer-scaling", "model", action="store_true")
    _flag(g, "--fp16-lm-cross-entropy", "model", action="store_true")
    _off(g, "--no-masked-softmax-fusion", "model", "masked_softmax_fusion")
    _off(g, "--no-bias-gelu-fusion", "model", "bias_gelu_fusion")
    _off(g, "--no-bias-dropout-fusion", "model", "bias_dropout_fusion")
    _off(g, "--no-persist-layer-norm", "model", "layer_norm_fusion")
    _off(g, "--no-layer-norm-fusion", "model", "layer_norm_fusion")
    _off(g, "--no-mask-vocab-padding", "model", "mask_vocab_padding")


def _add_architecture_args(parser):
    """The declarative model spec: positions, norms, MLP, attention groups, bias, tying."""
    g = parser.add_argument_group("architecture")
    _flag(g, "--position-embedding-type", "model", default=None,
          choices=list(POSITION_EMBEDDING_TYPES))
    _flag(g, "--use-rotary-position-embeddings", "model", "position_embedding_type",
          action="store_const", const="rope")
    _flag(g, "--rotary-percent", "model", type=float, default=None)
    _flag(g, "--rotary-base", "model", type=int, default=None)
    _flag(g, "--rotary-seq-len-interpolation-factor", "model", type=float, default=None)
    _add_long_context_args(g)
    _add_mla_args(g)
    _flag(g, "--normalization", "model", choices=list(NORMALIZATIONS), default=None)
    _flag(g, "--norm-epsilon", "model", "layernorm_epsilon", type=float, default=None)
    for name in ("--apply-layernorm-1p", "--qk-layernorm", "--embed-layernorm", "--scale-embeddings",
                 "--sandwich-norm",
                 "--group-query-attention", "--add-qkv-bias",
                 "--untie-embeddings-and-output-weights"):
        _flag(g, name, "model", action="store_true")
    _flag(g, "--glu-activation", "model", "activation", default=None,
          choices=sorted(GLU_ACTIVATIONS))
    for name, activation in (("--swiglu", "swiglu"), ("--quick-geglu", "quick_geglu"),
                             ("--openai-gelu", "openai_gelu"),
                             ("--exact-gelu", "exact_gelu"),
                             ("--squared-relu", "squared_relu")):
        _flag(g, name, "model", "activation", action="store_const", const=activation)
    for name in ("--num-query-groups", "--kv-channels", "--pad-vocab-size-to"):
        _flag(g, name, "model", type=int, default=None)
    for name in ("--embedding-multiplier", "--softmax-scale", "--glu-linear-offset",
                 "--activation-func-clamp-value"):
        _flag(g, name, "model", type=float, default=None)
    _flag(g, "--mtp-num-layers", "model", type=int, default=None)
    _flag(g, "--mtp-loss-scaling-factor", "model", type=float, default=0.1)
    _off(g, "--disable-bias-linear", "model", "add_bias_linear")


def _add_long_context_args(g):
    """RoPE scalings (llama3, yarn) and sliding-window attention."""
    _flag(g, "--rope-scaling-type", "model", default=None, choices=list(ROPE_SCALING_TYPES))
    _flag(g, "--use-rope-scaling", "model", "rope_scaling_type", action="store_const",
          const="llama3")
    for name in ("--rope-scaling-factor", "--rotary-scaling-factor"):
        _flag(g, name, "model", "rope_scaling_factor", type=float, default=None)
    for name in ("--rope-scaling-low-freq-factor", "--rope-scaling-high-freq-factor",
                 "--yarn-beta-fast", "--yarn-beta-slow", "--yarn-attention-factor"):
        _flag(g, name, "model", type=float, default=None)
    _flag(g, "--rope-scaling-original-max-position-embeddings", "model", type=int, default=None)
    _flag(g, "--no-yarn-correction-range-round-to-int", "model",
          "yarn_correction_range_round_to_int", action="store_const", const=False, default=None)
    _flag(g, "--window-size", "model", type=int, default=None)
    _off(g, "--no-rope-scaling-local", "model", "rope_scaling_local")
    _flag(g, "--window-attn-skip-freq", "model", default=None)
    _flag(g, "--rotary-base-local", "model", type=int, default=None)
    _flag(g, "--no-rope-freq", "model", default=None)
    _flag(g, "--softmax-type", "model", choices=list(SOFTMAX_TYPES), default=None)
    _add_llama4_attention_args(g)


def _add_llama4_attention_args(g):
    """Llama 4's attention: interleaved RoPE, q / k L2 norm, chunks, temperature tuning."""
    for name in ("--rotary-interleaved", "--qk-l2-norm", "--attn-temperature-tuning"):
        _flag(g, name, "model", action="store_true", default=None)
    for name in ("--attention-chunk-size", "--attn-temperature-floor-scale"):
        _flag(g, name, "model", type=int, default=None)
    _flag(g, "--attn-temperature-scale", "model", type=float, default=None)


def _add_mla_args(g):
    """Multi-latent attention (megatron/config/mla.py; Megatron-LM's names and defaults)."""
    _flag(g, "--multi-latent-attention", "model", action="store_true")
    for name in ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
                 "--v-head-dim"):
        _flag(g, name, "model", type=int, default=None)
    for name in ("--mscale", "--mscale-all-dim"):
        _flag(g, name, "model", type=float, default=None)


def _add_moe_args(parser):
    """Mixture of experts: Megatron-LM's --moe-* flags (megatron/config/moe.py)."""
    g = parser.add_argument_group("mixture of experts")
    for name in ("--num-experts", "--moe-ffn-hidden-size", "--moe-router-num-groups",
                 "--moe-router-group-topk", "--moe-shared-expert-intermediate-size"):
        _flag(g, name, "moe", type=int, default=None)
    _flag(g, "--moe-layer-freq", "moe", default=None)
    _flag(g, "--moe-router-topk", "moe", type=int, default=None)
    _flag(g, "--moe-router-score-function", "moe", choices=list(moe_choices.SCORE_FUNCTIONS),
          default=None)
    _flag(g, "--moe-router-load-balancing-type", "moe", default=None,
          choices=list(moe_choices.LOAD_BALANCING_TYPES))
    _flag(g, "--moe-token-dispatcher-type", "moe", choices=list(moe_choices.DISPATCHERS),
          default=None)
    _flag(g, "--moe-token-drop-policy", "moe", choices=list(moe_choices.DROP_POLICIES),
          default=None)
    _flag(g, "--moe-router-dtype", "moe", choices=list(moe_choices.ROUTER_DTYPES), default=None)
    for name in ("--moe-router-topk-scaling-factor", "--moe-aux-loss-coeff", "--moe-z-loss-coeff",
                 "--moe-router-bias-update-rate", "--moe-expert-capacity-factor"):
        _flag(g, name, "moe", type=float, default=None)
    for name in ("--moe-router-pre-softmax", "--moe-router-enable-expert-bias",
                 "--moe-pad-expert-input-to-capacity", "--moe-shared-expert-gate",
                 "--moe-grouped-gemm", "--moe-apply-probs-on-input"):
        _flag(g, name, "moe", action="store_true", default=None)
    _flag(g, "--expert-model-parallel-size", "parallel", type=int, default=1)
    _flag(g, "--expert-tensor-parallel-size", "parallel", type=int, default=None)


def _add_parallel_args(parser):
    g = parser.add_argument_group("parallelism")
    _flag(g, "--tensor-model-parallel-size", "parallel", type=int, default=1)
    _flag(g, "--pipeline-model-parallel-size", "parallel", type=int, default=1)
    _flag(g, "--num-layers-per-virtual-pipeline-stage", "parallel", type=int, default=None)
    _flag(g, "--pipeline-model-parallel-layout", "parallel", default=None)
    for name in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"):
        _flag(g, name, "parallel", type=int, default=None)
    _flag(g, "--context-parallel-size", "parallel", type=int, default=1)
    _flag(g, "--cp-comm-type", "parallel", choices=["p2p", "a2a"], default="p2p")
    _flag(g, "--sequence-parallel", "parallel", action="store_true")
    _flag(g, "--distributed-backend", "parallel", choices=["nccl", "gloo"], default=None)
    _flag(g, "--DDP-impl", "parallel", field="DDP_impl", choices=["local", "torch"], default="local")
    _flag(g, "--use-distributed-optimizer", "parallel", action="store_true")
    _flag(g, "--overlap-grad-reduce", "parallel", action="store_true")
    _flag(g, "--ddp-bucket-size", "parallel", type=int, default=40_000_000)
    _flag(g, "--accumulate-allreduce-grads-in-fp32", "parallel", action="store_true")
    _flag(g, "--use-torch-fsdp2", "parallel", action="store_true")
    g.add_argument("--fsdp-reshard-after-forward", dest="parallel.fsdp_reshard_after_forward",
                   action="store_true", default=True, help=HELP["--fsdp-reshard-after-forward"])
    g.add_argument("--no-fsdp-reshard-after-forward", "--torch-fsdp2-no-reshard-after-forward",
                   dest="parallel.fsdp_reshard_after_forward", action="store_false",
                   help=HELP["--no-fsdp-reshard-after-forward"])
    # torch.distributed.launch passes --local-rank (or --local_rank); torchrun sets LOCAL_RANK.
    g.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int, default=None,
                   help=HELP["--local-rank"])


def _add_training_args(parser):
    g = parser.add_argument_group("training")
    _flag(g, "--micro-batch-size", "training", type=int, default=1)
    _flag(g, "--global-batch-size", "training", type=int, default=None)
    _flag(g, "--rampup-batch-size", "training", type=int, nargs=3, default=None,
          metavar=("START", "INCR", "SAMPLES"))
    _flag(g, "--step-batch-size-schedule", "training", nargs="+", action=_JoinWords,
          default=None)
    _flag(g, "--train-iters", "training", type=int, default=None)
    _flag(g, "--train-samples", "training", type=int, default=None)
    _flag(g, "--seed", "training", type=int, default=1234)
    _flag(g, "--eval-interval", "training", type=int, default=1000)
    _flag(g, "--eval-iters", "training", type=int, default=100)
    _flag(g, "--exit-interval", "training", type=int, default=None)
    _flag(g, "--fp16", "training", action="store_true")
    _flag(g, "--bf16", "training", action="store_true")
    _flag(g, "--torch-compile", "training", action="store_true")


def _add_optimizer_args(parser):
    g = parser.add_argument_group("optimizer and learning rate")
    _flag(g, "--optimizer", "optimizer", choices=["adam", "sgd"], default="adam")
    _flag(g, "--lr", "optimizer", type=float, default=None)
    _flag(g, "--min-lr", "optimizer", type=float, default=0.0)
    _flag(g, "--lr-decay-style", "optimizer", default="linear",
          choices=["constant", "linear", "cosine", "inverse-square-root"])
    for name in ("--lr-decay-iters", "--lr-decay-samples"):
        _flag(g, name, "optimizer", type=int, default=None)
    _flag(g, "--lr-warmup-fraction", "optimizer", type=float, default=None)
    _flag(g, "--lr-warmup-iters", "optimizer", type=int, default=0)
    _flag(g, "--lr-warmup-samples", "optimizer", type=int, default=0)
    _flag(g, "--weight-decay", "optimizer", type=float, default=0.01)
    _flag(g, "--clip-grad", "optimizer", type=float, default=1.0)
    _flag(g, "--adam-beta1", "optimizer", type=float, default=0.9)
    _flag(g, "--adam-beta2", "optimizer", type=float, default=0.999)
    _flag(g, "--adam-eps", "optimizer", type=float, default=1e-8)
    _flag(g, "--sgd-momentum", "optimizer", type=float, default=0.9)
    _flag(g, "--loss-scale", "optimizer", type=float, default=None)
    _flag(g, "--initial-loss-scale", "optimizer", type=float, default=2.0 ** 32)
    _flag(g, "--min-loss-scale", "optimizer", type=float, default=1.0)
    _flag(g, "--loss-scale-window", "optimizer", type=int, default=1000)
    _flag(g, "--hysteresis", "optimizer", type=int, default=2)


def _add_data_args(parser):
    g = parser.add_argument_group("data and tokenizer")
    _flag(g, "--data-path", "data", nargs="*", default=[])
    _flag(g, "--split", "data", default="969,30,1")
    _flag(g, "--tokenizer-type", "data", default=None, choices=list(TOKENIZER_TYPES))
    for name in ("--vocab-file", "--merge-file", "--tokenizer-name-or-path", "--tokenizer-model",
                 "--data-cache-path"):
        _flag(g, name, "data", default=None)
    _flag(g, "--vocab-size", "data", type=int, default=None)
    _flag(g, "--dataloader-type", "data", choices=["single", "cyclic"], default="single")
    _flag(g, "--num-workers", "data", type=int, default=2)
    for name in ("--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask"):
        _flag(g, name, "data", action="store_true")


def _add_checkpoint_args(parser):
    g = parser.add_argument_group("checkpointing")
    _flag(g, "--save", "checkpoint", default=None)
    _flag(g, "--load", "checkpoint", default=None)
    _flag(g, "--save-interval", "checkpoint", type=int, default=None)
    for name in ("--no-save-optim", "--no-save-rng", "--no-load-optim", "--no-load-rng", "--finetune"):
        _flag(g, name, "checkpoint", action="store_true")
    _flag(g, "--ckpt-format", "checkpoint", choices=saved_formats(), default="torch")
    for name in ("--auto-detect-ckpt-format", "--async-save"):
        _flag(g, name, "checkpoint", action="store_true")


def _add_logging_args(parser):
    g = parser.add_argument_group("logging")
    _flag(g, "--log-interval", "logging", type=int, default=100)
    _flag(g, "--tensorboard-dir", "logging", default=None)
    _flag(g, "--tensorboard-queue-size", "logging", type=int, default=1000)
    _flag(g, "--timing-log-level", "logging", type=int, choices=[0, 1, 2], default=0)
    _flag(g, "--peak-flops", "logging", type=float, default=None)
    _flag(g, "--straggler-minmax-count", "logging", type=int, default=1)
    for name in ("--log-batch-size-to-tensorboard", "--log-validation-ppl-to-tensorboard",
                 "--log-timers-to-tensorboard", "--log-throughput", "--log-straggler"):
        _flag(g, name, "logging", action="store_true")


def _add_reliability_args(parser):
    g = parser.add_argument_group("reliability")
    _flag(g, "--exit-signal-handler", "training", action="store_true")
    _flag(g, "--exit-duration-in-mins", "training", type=float, default=None)
    _flag(g, "--kill-switch-path", "training", default=None)
    _flag(g, "--check-for-nan-in-loss-and-grad", "training", action="store_true")
    _flag(g, "--max-consecutive-nan-iterations", "training", type=int, default=10)
    _flag(g, "--distributed-timeout-minutes", "parallel", type=float, default=10.0)
    _off(g, "--no-verify-checkpoint", "checkpoint", "verify_checkpoint")


def _add_compat_args(parser):
    """Megatron-LM and Megatron-DeepSpeed spellings (mapped in megatron/compat.py)."""
    g = parser.add_argument_group("Megatron-LM / Megatron-DeepSpeed compatibility")
    _flag(g, "--recompute-activations", "model", "recompute_granularity",
          action="store_const", const="selective")
    _flag(g, "--recompute-method", "model", choices=["uniform", "block"], default=None)
    _flag(g, "--recompute-num-layers", "model", "checkpoint_num_layers", type=int, default=None)
    _flag(g, "--no-query-key-layer-scaling", "model", "apply_query_key_layer_scaling",
          action="store_const", const=False)
    _flag(g, "--use-flash-attn", "model", "attention_impl", action="store_const", const="sdpa")
    _flag(g, "--attention-backend", "compat", choices=sorted(ATTENTION_BACKENDS), default=None)
    _flag(g, "--data-impl", "compat", choices=["mmap", "infer", "lazy", "cached"], default=None)
    _flag(g, "--mock-data", "data", action="store_true")
    for split in ("train", "valid", "test"):
        _flag(g, f"--{split}-weighted-split-paths", "data", nargs="*", default=None)
    _flag(g, "--separate-last-epoch-threshold", "data", type=float, default=0.80)
    for name in ("--log-params-norm", "--log-num-zeros-in-grad"):
        _flag(g, name, "logging", action="store_true")
    _flag(g, "--train-tokens", "training", type=int, default=None)
    _flag(g, "--skip-train-iteration-range", "training", nargs="+", default=None)
    _flag(g, "--lr-decay-tokens", "optimizer", type=int, default=None)
    for name in ("--override-opt_param-scheduler", "--override-lr-scheduler"):
        _flag(g, name, "optimizer", "override_opt_param_scheduler", action="store_true")
    for name in ("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-lr-scheduler"):
        _flag(g, name, "optimizer", "use_checkpoint_opt_param_scheduler", action="store_true")
    _flag(g, "--universal-checkpoint", "checkpoint", action="store_true")
    for name in ("--use-mcore-models", "--no-position-embedding", "--overlap-param-gather"):
        _flag(g, name, "compat", action="store_true")  # Megatron-LM MoE scripts (compat.py)
    add_deepspeed_args(g, _flag)


def build_parser(description: str = "Megatron-style GPT pretraining") -> argparse.ArgumentParser:
    parser = OneLineParser(description=description, allow_abbrev=False)
    for add in (_add_model_args, _add_architecture_args, _add_moe_args, _add_parallel_args, _add_training_args,
                _add_optimizer_args, _add_data_args, _add_checkpoint_args, _add_logging_args,
                _add_reliability_args, _add_compat_args):
        add(parser)
    return parser


def config_from_namespace(ns: argparse.Namespace) -> Config:
    """Build (and validate each section of) the Config from parsed flags."""
    values = {name: {} for name in (*SECTIONS, "moe")}
    for dest, value in vars(ns).items():
        section, _, field = dest.partition(".")
        if section in values and value is not None:
            values[section][field] = value
    moe = MoEConfig(**values.pop("moe"))  # validated even when --num-experts is not given
    values["model"]["moe"] = moe if moe.enabled else None
    return Config(**{name: cls(**values[name]) for name, cls in SECTIONS.items()})


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def fail(message: str, prog: Optional[str] = None, agreed: bool = False,
         per_host: bool = False) -> None:
    """Print one line and exit with status 2 (argparse's convention for bad usage).

    Under torchrun, before the process group starts every rank checks the same flags and
    files, so only rank 0 prints; the others exit 2 silently, a moment later (one still
    importing when rank 0 exits is stopped by torchrun instead). So it is for
    an `agreed` error (every rank raised it together: a --save lock refusal, a save that
    failed on some rank; io.CheckpointError.agreed). A `per_host` error (a host's own
    network interfaces) is printed by the first rank of each host (LOCAL_RANK 0)."""
    prog = prog or os.path.basename(sys.argv[0] or "megatron")
    _finish_exit_under_launcher()
    if per_host:
        quiet = os.environ.get("LOCAL_RANK", "0") != "0"
    else:
        quiet = _shared_check_on_other_rank() or (agreed and os.environ.get("RANK", "0") != "0")
    if quiet:
        time.sleep(OTHER_RANK_EXIT_DELAY)  # rank 0 prints and exits first: torchrun's root cause
    else:
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    if "TORCHELASTIC_RUN_ID" in os.environ and _process_group_started():
        # A torchrun rank with its process group up: the interpreter's teardown can abort on
        # a C++ thread still joinable ("terminate called without an active exception", exit
        # -6 instead of 2, seen once in tests/distributed/test_reliability_ranks.py), and a
        # failed run has nothing left to clean up, so it leaves without one.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)
    sys.exit(2)


def _process_group_started() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


OTHER_RANK_EXIT_DELAY = 3.0


def _finish_exit_under_launcher() -> None:
    """Under torchrun, the first rank to exit makes the launcher SIGTERM the others; a rank
    already on its way out ignores that, so its line is printed and its status stays 2."""
    if "RANK" in os.environ:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        except ValueError:  # not the main thread
            pass


def _shared_check_on_other_rank() -> bool:
    return os.environ.get("RANK", "0") != "0" and not _process_group_started()


def parse_args(argv: Optional[List[str]] = None, parser: Optional[argparse.ArgumentParser] = None,
               world_size: Optional[int] = None, required: Sequence[str] = (),
               complete: Optional[Callable[[argparse.Namespace], None]] = None):
    """Parse flags into a validated Config; bad values exit 2 with one line.

    `required`: flags (e.g. "--num-layers") that must be given explicitly. `complete`: an
    entry point's completion of the parsed flags before they are checked (values read from a
    checkpoint); it raises ConfigError or CheckpointError.
    Returns (config, namespace): the namespace keeps extra flags an entry point added.
    """
    parser = parser or build_parser()
    ns = parser.parse_args(argv)
    dests = {o: a.dest for a in parser._actions for o in a.option_strings}  # no public map
    missing = [flag for flag in required if getattr(ns, dests[flag]) is None]
    if missing:
        fail(f"missing required flags: {' '.join(missing)}")
    if ns.local_rank is not None and "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(ns.local_rank)
    try:
        if complete is not None:
            complete(ns)
        apply_compat(ns, parser, sys.argv[1:] if argv is None else argv,
                     world_size or world_size_from_env())
        config = config_from_namespace(ns)
        config.check_layout(world_size or world_size_from_env())
    except (ConfigError, CheckpointError, OSError) as err:
        fail(str(err).splitlines()[0])
    except TypeError as err:  # a required section value is missing
        fail(str(err))
    return config, ns
