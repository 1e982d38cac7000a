"""Re-shard a GPT checkpoint to another tensor / pipeline parallel layout, or convert it
between the torch, torch_dist and torch_dcp formats (the input's format is detected).

    python tools/merge_mp_partitions.py --load CKPT --save OUT \\
        --target-tensor-model-parallel-size 1 --target-pipeline-model-parallel-size 1
    python tools/merge_mp_partitions.py --load CKPT --save OUT \\
        --target-tensor-model-parallel-size 2 --target-expert-model-parallel-size 2 \\
        --target-expert-tensor-parallel-size 1
    python tools/merge_mp_partitions.py --load CKPT --save OUT --ckpt-format torch_dist

The input is only read, and checked as --load checks it (digests, the stored iteration
against the tracker, finite values); the output is written under a temporary name and
renamed. A checkpoint that stores no configuration (a bare directory of Megatron-Core's
`dist_checkpointing.save`) is given its model flags, as Megatron-LM's tool is
(--num-layers, --hidden-size, --num-attention-heads, --max-position-embeddings, ...).
Problems are one line and exit 2. Any registered format reads and writes through the front
door (megatron/checkpointing/api.py: `convert`); how shards are merged and split:
megatron/checkpointing/reshard.py (weights and counters; no optimizer state).
"""
import argparse
import os
import sys

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from megatron.checkpointing import api  # noqa: E402
from megatron.checkpointing.formats import Target  # noqa: E402
from megatron.checkpointing.io import CheckpointError  # noqa: E402
from megatron.checkpointing.reshard import ReshardError  # noqa: E402
from megatron.training.checkpoint_setup import model_from_flags  # noqa: E402


def get_args(argv=None):
    parser = argparse.ArgumentParser(description="Re-shard a GPT checkpoint (TP merge/split, "
                                                 "new PP split)", allow_abbrev=False)
    parser.add_argument("--load", required=True, help="checkpoint directory to read")
    parser.add_argument("--save", required=True, help="directory to write the new checkpoint to")
    parser.add_argument("--target-tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--target-pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--ckpt-format", choices=api.saved_formats(), default="torch",
                        help="format of the output (torch_dist and torch_dcp have no "
                             "layout: the target sizes apply to torch)")
    parser.add_argument("--target-expert-model-parallel-size", type=int, default=1,
                        help="split MoE experts over this many EP ranks (mp_rank_TT[_PPP]_EEE)")
    parser.add_argument("--target-expert-tensor-parallel-size", type=int, default=None,
                        help="split each MoE expert over this many ranks, a divisor of the "
                             "target TP (default: the target TP)")
    parser.add_argument("--model-type", choices=["GPT"], default="GPT",
                        help="accepted for Megatron compatibility (GPT only)")
    args, rest = parser.parse_known_args(argv)
    # Megatron-LM's invocation also passes the model, tokenizer and source-layout flags
    # (--tensor-model-parallel-size, --num-layers, --vocab-file, ...): checked to be valid
    # training flags (a typo is still an error); the model flags describe a checkpoint that
    # stores no configuration (a bare Megatron-Core directory), otherwise the stored one is
    # used.
    args.model = model_from_flags(rest, "merge_mp_partitions.py") if rest else None
    return args


def main(argv=None) -> int:
    args = get_args(argv)
    tp, pp = args.target_tensor_model_parallel_size, args.target_pipeline_model_parallel_size
    ep, etp = args.target_expert_model_parallel_size, args.target_expert_tensor_parallel_size
    try:
        path = api.convert(args.load, args.save, args.ckpt_format, Target(tp, pp, ep, etp),
                           args.model)
    except (ReshardError, CheckpointError, OSError, RuntimeError) as err:
        print(f"merge_mp_partitions.py: error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    layout = (args.ckpt_format if api.format_named(args.ckpt_format).reshards_on_load
              else f"TP={tp} PP={pp}{f' EP={ep}' if ep > 1 else ''}"
                   f"{f' ETP={etp}' if etp not in (None, tp) else ''}")
    print(f" re-sharded {args.load} to {layout}: {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
