"""Zero-shot evaluation of a GPT checkpoint (Megatron's `tasks/main.py` for GPT).

    python tasks/main.py --task WIKITEXT103 --valid-data wiki.test.tokens --load CKPT \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --micro-batch-size 8 --overlapping-eval 32
    python tasks/main.py --task LAMBADA --valid-data lambada_test.jsonl --strict-lambada ...

Model and tokenizer flags default to the checkpoint's stored config (flags given
win); --seq-length is the evaluation window. Run under torchrun with the
checkpoint's --tensor-model-parallel-size / --pipeline-model-parallel-size;
extra processes evaluate data-parallel. Prints
` avg loss: X | ppl: Y | adjusted ppl: Z | token ratio: R |` (WIKITEXT103) or
` number correct: N | total examples: M | avg accuracy: A |` (LAMBADA).
"""
import os
import sys
from typing import Dict

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from megatron.arguments import build_parser, fail  # noqa: E402
from megatron.training.loading import (build_tokenizer_and_vocab,  # noqa: E402
                                              load_inference_models, parse_inference_args)
from megatron.training.checkpointing import CheckpointError  # noqa: E402
from megatron.training.initialize import initialize_distributed  # noqa: E402
from megatron.training.trainer import print_rank_last  # noqa: E402
from tasks.zeroshot_gpt.datasets import TaskDataError, read_lambada, read_wikitext  # noqa: E402
from tasks.zeroshot_gpt.evaluate import (TASKS, WIKITEXT, evaluate,  # noqa: E402
                                         format_metrics, lambada_metrics, wikitext_metrics)


def get_parser():
    parser = build_parser("Zero-shot evaluation of a GPT checkpoint")
    g = parser.add_argument_group("tasks")
    g.add_argument("--task", required=True, choices=TASKS)
    g.add_argument("--valid-data", nargs="+", default=None,
                   help="evaluation file (the first one is used)")
    g.add_argument("--overlapping-eval", type=int, default=None,
                   help="WIKITEXT103: window stride; only the last N labels of a window count "
                        "(default 32, or --seq-length when shorter)")
    g.add_argument("--strict-lambada", action="store_true",
                   help="LAMBADA: the target is the last whitespace word, not the last BPE token")
    return parser


def window_stride(ns, seq_length: int) -> int:
    """--overlapping-eval, by default 32 (Megatron's) or the window when it is shorter."""
    return min(32, seq_length) if ns.overlapping_eval is None else ns.overlapping_eval


def build_dataset(ns, tokenizer, seq_length: int):
    path = ns.valid_data[0]
    if ns.task == WIKITEXT:
        return read_wikitext(path, tokenizer, seq_length, window_stride(ns, seq_length))
    return read_lambada(path, tokenizer, seq_length, ns.strict_lambada)


def metrics_of(task: str, dataset, total: float) -> Dict[str, float]:
    if task == WIKITEXT:
        return wikitext_metrics(total, dataset.num_tokenized_tokens, dataset.num_original_tokens)
    return lambada_metrics(total, len(dataset))


def report(task: str, metrics: Dict[str, float]) -> None:
    line = format_metrics(task, metrics)
    rule = "-" * len(line)
    print_rank_last(f"{rule}\n validation results on {task}\n{line}\n{rule}")


def main(argv=None) -> Dict[str, float]:
    """Evaluate; returns the metrics (also printed on the last rank)."""
    config, ns, stored = parse_inference_args(get_parser(), argv)
    if not ns.valid_data:
        fail("--valid-data is required: the evaluation file")
    seq_length = config.model.seq_length
    stride = window_stride(ns, seq_length)
    if ns.task == WIKITEXT and not 1 <= stride <= seq_length:
        fail(f"--overlapping-eval ({stride}) must be in 1..{seq_length} (--seq-length)")
    tokenizer = build_tokenizer_and_vocab(config, stored)
    pstate, device = initialize_distributed(config)
    try:
        dataset = build_dataset(ns, tokenizer, seq_length)
        models, _ = load_inference_models(config, pstate, device, parallel_output=False)
    except (TaskDataError, CheckpointError) as err:
        print(f"{os.path.basename(sys.argv[0])}: error: {err}", file=sys.stderr)
        sys.exit(1)
    total = evaluate(ns.task, dataset, models, config, pstate, device, tokenizer.eod,
                     tokenizer.vocab_size)
    metrics = metrics_of(ns.task, dataset, total)
    report(ns.task, metrics)
    return metrics


if __name__ == "__main__":
    main()
