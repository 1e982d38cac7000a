"""Zero-shot evaluation of a GPT checkpoint (Megatron's `tasks/main.py` for GPT).

    python tasks/main.py --task WIKITEXT103 --valid-data wiki.test.tokens --load CKPT \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --batch-size 8 --overlapping-eval 32 --log-interval 10
    python tasks/main.py --task LAMBADA --valid-data lambada_test.jsonl --strict-lambada ...

Model and tokenizer flags default to the checkpoint's stored config (flags given
win); --seq-length is the evaluation window. Run under torchrun with the
checkpoint's --tensor-model-parallel-size / --pipeline-model-parallel-size;
extra processes evaluate data-parallel. Prints what Megatron prints: the data
set's size, a progress line every --log-interval batches, then one result line
` validation results on WIKITEXT103 | avg loss: ... | ppl: ... | adjusted ppl: ... |
token ratio: ... |` or ` validation results on LAMBADA | number correct: ... | total examples:
... | avg accuracy: ...` (each on one line) between dashed rules, and `done :-)`.
--results-json writes the values at full precision.

fairseq's evaluation (--fairseq-eval-lm, WIKITEXT103 only): the token stream of
fairseq-preprocess (each line -> BPE -> dictionary ids -> `</s>`) scored in blocks of
--tokens-per-sample with --context-window tokens of context, as fairseq-eval-lm;
prints fairseq's `Loss (base 2): ..., Perplexity: ...` and the perplexity renormalised
to words, 2 ** (loss * bpe tokens / word tokens), with both counts:

    python tasks/main.py --task WIKITEXT103 --fairseq-eval-lm --valid-data wiki.test.tokens \
        --detokenizer fairseq --tokens-per-sample 1024 --context-window 992 --load CKPT
"""
import argparse
import json
import os
import sys
from typing import Dict

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from megatron.arguments import build_parser, fail  # noqa: E402
from megatron.training.checkpoint_setup import (build_tokenizer_and_vocab,  # noqa: E402
                                            load_inference_models, parse_inference_args)
from megatron.checkpointing.io import CheckpointError  # noqa: E402
from megatron.files import write_text_durably  # noqa: E402
from megatron.training.initialize import initialize_distributed  # noqa: E402
from megatron.training.trainer import is_last_rank, print_rank_0, print_rank_last  # noqa: E402
from tasks.fairseq_lm.detok import MissingSacremoses, moses_detokenizer  # noqa: E402
from tasks.fairseq_lm.stream import (fairseq_metrics, format_fairseq,  # noqa: E402
                                     read_fairseq_stream)
from tasks.zeroshot_gpt.datasets import TaskDataError, read_lambada, read_wikitext  # noqa: E402
from tasks.zeroshot_gpt.detokenizer import (DETOKENIZERS, detokenize,  # noqa: E402
                                            detokenizer_for_path)
from tasks.zeroshot_gpt.evaluate import (TASKS, WIKITEXT, evaluate,  # noqa: E402
                                         format_metrics, lambada_metrics, wikitext_metrics)


def get_parser():
    parser = build_parser("Zero-shot evaluation of a GPT checkpoint")
    g = parser.add_argument_group("tasks")
    g.add_argument("--task", required=True, choices=TASKS)
    g.add_argument("--valid-data", nargs="+", default=None, help="the evaluation file (one)")
    g.add_argument("--batch-size", dest="training.micro_batch_size", type=int,
                   default=argparse.SUPPRESS, help="alias of --micro-batch-size (Megatron's name)")
    g.add_argument("--overlapping-eval", type=int, default=None,
                   help="WIKITEXT103: window stride; only the last N labels of a window count "
                        "(default 32, or --seq-length when shorter)")
    g.add_argument("--strict-lambada", action="store_true",
                   help="LAMBADA: the target is the last whitespace word, not the last BPE token")
    g.add_argument("--detokenizer", choices=DETOKENIZERS, default=None,
                   help="undo the file's word tokenization with these rules; by default, as in "
                        "Megatron, WIKITEXT103 picks them from the file name (ptb, wiki, "
                        "lambada; none when no name matches) and LAMBADA uses none")
    g.add_argument("--fairseq-eval-lm", action="store_true",
                   help="WIKITEXT103 as fairseq-preprocess + fairseq-eval-lm: a </s> after each "
                        "line, blocks of --tokens-per-sample, base-2 loss; the detokenizer is "
                        "none unless --detokenizer (the seed's: fairseq)")
    g.add_argument("--tokens-per-sample", type=int, default=None,
                   help="--fairseq-eval-lm: tokens per evaluated sequence, context included "
                        "(default --seq-length); it becomes the evaluation --seq-length")
    g.add_argument("--context-window", type=int, default=0,
                   help="--fairseq-eval-lm: tokens of context before each block of "
                        "tokens-per-sample minus context-window scored tokens")
    g.add_argument("--results-json", default=None,
                   help="also write the results at full precision to this JSON file")
    return parser


def window_stride(ns, seq_length: int) -> int:
    """--overlapping-eval, by default 32 (Megatron's) or the window when it is shorter."""
    return min(32, seq_length) if ns.overlapping_eval is None else ns.overlapping_eval


def detokenizer_of(ns) -> str:
    """--detokenizer, else Megatron's choice: by file name for WIKITEXT103, none for LAMBADA."""
    if ns.detokenizer is not None:
        return ns.detokenizer
    if ns.task != WIKITEXT or ns.fairseq_eval_lm:
        return "none"
    return detokenizer_for_path(ns.valid_data[0]) or "none"


def build_dataset(ns, tokenizer, seq_length: int):
    path, detokenizer = ns.valid_data[0], detokenizer_of(ns)
    if ns.fairseq_eval_lm:
        dataset = read_fairseq_stream(path, tokenizer, lambda text: detokenize(detokenizer, text),
                                      seq_length, ns.context_window)
        print_rank_0(f" > number of word tokens: {dataset.num_original_tokens}, number of bpe "
                     f"tokens: {dataset.num_tokenized_tokens} (a </s> ends each line), "
                     f"{len(dataset)} blocks")
        return dataset
    if ns.task == WIKITEXT:
        dataset = read_wikitext(path, tokenizer, seq_length, window_stride(ns, seq_length),
                                detokenizer)
        print_rank_0(f" > number of original tokens: {dataset.num_original_tokens}, number of "
                     f"detokenized tokens: {dataset.num_tokenized_tokens}")
        return dataset
    dataset = read_lambada(path, tokenizer, seq_length, ns.strict_lambada, detokenizer)
    print_rank_0(f" > found {len(dataset)} samples.")
    print_rank_0(f" > {dataset.num_truncated} of {len(dataset)} contexts truncated from the left "
                 f"(longer than --seq-length {seq_length})")
    return dataset


def metrics_of(task: str, dataset, total: float, fairseq: bool = False) -> Dict[str, float]:
    if fairseq:
        return fairseq_metrics(total, dataset.num_tokenized_tokens, dataset.num_original_tokens)
    if task == WIKITEXT:
        return wikitext_metrics(total, dataset.num_tokenized_tokens, dataset.num_original_tokens)
    return lambada_metrics(total, len(dataset))


def report(task: str, metrics: Dict[str, float], fairseq: bool = False) -> None:
    if fairseq:
        fairseq_line, line = format_fairseq(metrics).split("\n")
        print_rank_last(fairseq_line)
    else:
        line = format_metrics(task, metrics)
    rule = "-" * (len(line) + 1)
    print_rank_last(f"{rule}\n{line}\n{rule}")


def write_results(path: str, task: str, metrics: Dict[str, float], dataset) -> None:
    """The metrics and the data set's counts as JSON, written atomically."""
    record = {"task": task, **metrics}
    if "bpe tokens" in metrics:  # --fairseq-eval-lm: its metrics hold the counts
        record["blocks"] = len(dataset)
    elif task == WIKITEXT:
        record.update({"num original tokens": dataset.num_original_tokens,
                       "num tokenized tokens": dataset.num_tokenized_tokens})
    else:
        record["num truncated contexts"] = dataset.num_truncated
    write_text_durably(path, json.dumps(record, indent=1) + "\n")


def check_flags(ns, seq_length: int) -> None:
    if not ns.valid_data:
        fail("--valid-data is required: the evaluation file")
    if len(ns.valid_data) > 1:
        fail(f"--valid-data takes exactly one file, got {len(ns.valid_data)}: "
             f"{' '.join(ns.valid_data)}")
    if detokenizer_of(ns) == "fairseq":
        check_sacremoses()
    if ns.fairseq_eval_lm:
        check_fairseq_flags(ns, seq_length)
        return
    stride = window_stride(ns, seq_length)
    if ns.task == WIKITEXT and not 1 <= stride <= seq_length:
        fail(f"--overlapping-eval ({stride}) must be in 1..{seq_length} (--seq-length)")


def check_fairseq_flags(ns, seq_length: int) -> None:
    if ns.task != WIKITEXT:
        fail(f"--fairseq-eval-lm evaluates WIKITEXT103 (language modelling), not {ns.task}")
    if not 0 <= ns.context_window < seq_length:
        fail(f"--context-window ({ns.context_window}) must be in 0..{seq_length - 1} (below "
             f"--tokens-per-sample {seq_length})")


def check_sacremoses() -> None:
    """--detokenizer fairseq needs sacremoses: one line and exit 2 without it."""
    try:
        moses_detokenizer()
    except MissingSacremoses as err:
        fail(str(err))


def evaluation_length(config, ns) -> int:
    """The window: --tokens-per-sample with --fairseq-eval-lm, else --seq-length."""
    if not getattr(ns, "fairseq_eval_lm", False) or ns.tokens_per_sample is None:
        return config.model.seq_length
    limit = config.model.max_position_embeddings
    if not 1 <= ns.tokens_per_sample <= limit:
        fail(f"--tokens-per-sample ({ns.tokens_per_sample}) must be in 1..{limit} (the model's "
             f"--max-position-embeddings)")
    config.model.seq_length = ns.tokens_per_sample
    return ns.tokens_per_sample


def main(argv=None) -> Dict[str, float]:
    """Evaluate; returns the metrics (also printed on the last rank)."""
    config, ns, stored = parse_inference_args(get_parser(), argv)
    seq_length = evaluation_length(config, ns)
    check_flags(ns, seq_length)
    tokenizer = build_tokenizer_and_vocab(config, stored)
    pstate, device = initialize_distributed(config)
    try:
        dataset = build_dataset(ns, tokenizer, seq_length)
        models, _ = load_inference_models(config, pstate, device, parallel_output=False,
                                          vocab_size=tokenizer.vocab_size)
    except (TaskDataError, CheckpointError) as err:
        fail(str(err))
    total = evaluate(ns.task, dataset, models, config, pstate, device, tokenizer.eod,
                     log_interval=config.logging.log_interval)
    metrics = metrics_of(ns.task, dataset, total, ns.fairseq_eval_lm)
    report(ns.task, metrics, ns.fairseq_eval_lm)
    if ns.results_json and is_last_rank():
        write_results(ns.results_json, ns.task, metrics, dataset)
    print_rank_last("done :-)")  # the rank that printed the result line: always after it
    return metrics


if __name__ == "__main__":
    main()
