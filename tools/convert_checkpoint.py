"""Convert checkpoints between Hugging Face `transformers` or fairseq and this framework.

    python tools/convert_checkpoint.py --from hf --to megatron --load HF_DIR --save CKPT \\
        [--target-tensor-model-parallel-size T --target-pipeline-model-parallel-size P]
    python tools/convert_checkpoint.py --from megatron --to hf --load CKPT --save HF_DIR
    python tools/convert_checkpoint.py --from fairseq --to megatron --load DIR/model.pt \\
        --save CKPT [--fairseq-dict dict.txt --vocab-file encoder.json --merge-file vocab.bpe]
    python tools/convert_checkpoint.py --from megatron --to fairseq --load CKPT --save DIR
    python tools/convert_checkpoint.py --from megatron --to hf --load MCORE_DIR --save HF_DIR \
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 16 \
        --hf-vocab-size 128    # a checkpoint that stores no configuration: its model flags

fairseq: a single model.pt or its model-parallel partitions DIR/model-model_part-K.pt
(--load DIR/model.pt or DIR finds them) with the dict.txt beside it; the rows stay in
the dictionary's order (tokenizer FairseqGPT2BPETokenizer, see megatron/checkpointing/fairseq).

Supported: GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, BloomForCausalLM,
read from / written to config.json + model.safetensors (a sharded
model.safetensors.index.json is read too). The Megatron checkpoint is a
`release` checkpoint that pretrain_gpt.py takes with --load (or --finetune) and
the model flags of the converted config. --to hf also exports checkpoints trained
here (GPT-2, LLaMA or BLOOM, by their position encoding), keeping --hf-vocab-size
rows (default: the size of the tokenizer they were trained with).
"""
import argparse
import os
import sys

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from megatron.checkpointing.fairseq.convert import (fairseq_to_megatron,  # noqa: E402
                                                    megatron_to_fairseq)
from megatron.checkpointing.hf import ConversionError  # noqa: E402
from megatron.checkpointing.hf.convert import (VocabOptions, hf_to_megatron,  # noqa: E402
                                               megatron_to_hf)
from megatron.checkpointing.io import CheckpointError  # noqa: E402
from megatron.checkpointing.reshard import ReshardError  # noqa: E402
from megatron.training.checkpoint_setup import model_from_flags  # noqa: E402

DIRECTIONS = {("hf", "megatron"), ("megatron", "hf"), ("fairseq", "megatron"),
              ("megatron", "fairseq")}
FORMATS = ["hf", "megatron", "fairseq"]


def get_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Convert Hugging Face / fairseq <-> Megatron checkpoints", allow_abbrev=False)
    parser.add_argument("--from", dest="source", choices=FORMATS, required=True)
    parser.add_argument("--to", dest="target", choices=FORMATS, required=True)
    parser.add_argument("--load", required=True,
                        help="directory to read (fairseq: also a model.pt file)")
    parser.add_argument("--save", required=True, help="directory to write (new or empty)")
    parser.add_argument("--target-tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--target-pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                        help="pad the vocabulary to a multiple of this x the target TP size")
    parser.add_argument("--pad-vocab-size-to", type=int, default=None,
                        help="pad the vocabulary to exactly this many rows")
    parser.add_argument("--hf-vocab-size", type=int, default=None,
                        help="--to hf from a checkpoint not converted from HF: the real "
                             "vocabulary size (default: its tokenizer's)")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="training sequence length stored with the model (default: its "
                             "max positions; BLOOM: 2048)")
    parser.add_argument("--fairseq-dict", default=None,
                        help="--from fairseq: the model's dict.txt (default: beside the checkpoint)")
    parser.add_argument("--vocab-file", default=None,
                        help="--from fairseq: GPT-2 encoder.json stored as the tokenizer's")
    parser.add_argument("--merge-file", default=None,
                        help="--from fairseq: GPT-2 vocab.bpe stored as the tokenizer's")
    return parser


def convert(args, model=None) -> str:
    if (args.source, args.target) not in DIRECTIONS:
        raise ConversionError(f"--from {args.source} --to {args.target}: convert between hf "
                              f"or fairseq and megatron")
    if args.target == "fairseq":
        return megatron_to_fairseq(args.load, args.save)
    if args.target == "hf":
        return megatron_to_hf(args.load, args.save, args.hf_vocab_size, model)
    tp, pp = args.target_tensor_model_parallel_size, args.target_pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise ConversionError(f"target sizes must be >= 1, got TP {tp} and PP {pp}")
    vocab = VocabOptions(args.make_vocab_size_divisible_by, args.pad_vocab_size_to)
    if args.source == "fairseq":
        return fairseq_to_megatron(args.load, args.save, tp, pp, args.fairseq_dict,
                                   args.vocab_file, args.merge_file, args.seq_length, vocab)
    return hf_to_megatron(args.load, args.save, tp, pp, args.seq_length, vocab)


def parse(argv=None):
    """(args, model): --from megatron also takes Megatron's model flags (--num-layers, ...)
    for a checkpoint that stores no configuration (a bare Megatron-Core directory)."""
    parser = get_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.source != "megatron":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args, model_from_flags(rest, "convert_checkpoint.py") if rest else None


def main(argv=None) -> int:
    args, model = parse(argv)
    try:
        path = convert(args, model)
    except (ConversionError, ReshardError, CheckpointError, OSError, KeyError) as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
        print(f"convert_checkpoint.py: error: {message}", file=sys.stderr)
        return 2
    print(f" converted {args.load} ({args.source}) to {path} ({args.target})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
