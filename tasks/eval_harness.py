"""Run EleutherAI's lm-evaluation-harness (`lm_eval`, 0.4.x) on a GPT checkpoint.

    python tasks/eval_harness.py --load CKPT --tasks lambada_openai,hellaswag,wikitext \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --batch-size 8
    torchrun --nproc_per_node 2 tasks/eval_harness.py --load CKPT --tensor-model-parallel-size 2 ...

The checkpoint becomes an `lm_eval` model (`MegatronLM`) with `loglikelihood`,
`loglikelihood_rolling` and `generate_until`; `--tasks` are the harness's task
names, and `--include-path DIR` adds the YAML tasks of a local folder. Model and
tokenizer flags default to the checkpoint's stored config. With tensor
parallelism every rank runs the same harness and the model's collectives keep
them together; rank 0 prints the table and writes --results-json. Pipeline-
parallel checkpoints must be re-sharded to one stage first.

Scoring follows tasks/main.py, so the numbers agree with it: a continuation
longer than the --seq-length window keeps its last tokens (context cut from the
left); a rolling log-likelihood reads the text in the WIKITEXT103 windows
(stride --overlapping-eval) with the first token conditioned on end-of-document;
log-probabilities are normalized over the tokenizer's vocabulary (the padding
rows' logits are -inf, as in tasks/main.py), and greedy checks never pick a
padding id. generate_until decodes
greedily (sampling when a task asks for do_sample) and cuts at the first stop
string. --offline sets HF_DATASETS_OFFLINE / HF_HUB_OFFLINE, for local tasks.
"""
import argparse
import json
import os
import sys
from typing import Dict, List, Sequence, Tuple

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron.arguments import build_parser, fail  # noqa: E402
from megatron.text_generation import GenerationError, forward_full, generate  # noqa: E402
from megatron.checkpointing.io import CheckpointError  # noqa: E402
from megatron.training.initialize import initialize_distributed  # noqa: E402
from megatron.training.checkpoint_setup import (build_tokenizer_and_vocab,  # noqa: E402
                                            load_inference_models, parse_inference_args)
from tasks.zeroshot_gpt.datasets import LambadaExamples, WikitextWindows  # noqa: E402

Sample = Tuple[np.ndarray, np.ndarray]  # tokens [seq + 1], mask of scored labels [seq]


@torch.no_grad()
def score_samples(model, samples: Sequence[Sample]) -> List[Tuple[float, bool]]:
    """(summed log-probability of the scored labels, all of them greedy) of each sample
    (the model is loaded with `vocab_limit`, so padding ids have -inf logits)."""
    tokens = torch.from_numpy(np.stack([s[0] for s in samples]))
    mask = torch.from_numpy(np.stack([s[1] for s in samples])) > 0
    scored = mask.any(dim=0).nonzero()
    length = int(scored.max()) + 1 if len(scored) else 1  # later positions do not matter
    device = model.head_weight().device
    inputs = tokens[:, :length].to(device)
    labels, mask = tokens[:, 1:length + 1].to(device), mask[:, :length].to(device)
    logits = forward_full(model, inputs).float()
    log_probs = F.log_softmax(logits, dim=-1).gather(-1, labels[..., None])[..., 0]
    greedy = (logits.argmax(dim=-1) == labels) | ~mask
    sums = (log_probs * mask).double().sum(dim=-1)
    return [(float(s), bool(g)) for s, g in zip(sums.tolist(), greedy.all(dim=-1).tolist())]


def _batched(items: Sequence, size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _stop_at(text: str, until: Sequence[str]) -> str:
    cuts = [text.find(s) for s in until if s and s in text]
    return text[:min(cuts)] if cuts else text


class HarnessModel:
    """A loaded GPT (one pipeline stage, any TP) as an lm-evaluation-harness model (its
    methods; `harness_model_class` puts them on lm_eval's LM)."""

    def __init__(self, model, tokenizer, seq_length: int, stride: int, batch_size: int):
        super().__init__()
        self.model, self.tokenizer = model, tokenizer
        self.seq_length, self.stride, self.batch_size = seq_length, stride, batch_size
        self.eod = tokenizer.eod

    def _score(self, samples: List[Sample]) -> List[Tuple[float, bool]]:
        out = []
        for batch in _batched(samples, self.batch_size):
            out += score_samples(self.model, batch)
        return out

    def _pair(self, context: str, continuation: str) -> Tuple[List[int], List[int]]:
        spaces = len(context) - len(context.rstrip(" "))
        if spaces:  # word-boundary spaces belong to the continuation
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        ids = self.tokenizer.tokenize(context) if context else [self.eod]
        return ids, self.tokenizer.tokenize(continuation)

    def loglikelihood(self, requests) -> List[Tuple[float, bool]]:
        pairs = [self._pair(*req.args) for req in requests]
        too_long = [len(c) for _, c in pairs if not 0 < len(c) <= self.seq_length]
        if too_long:
            raise ValueError(f"a continuation has {too_long[0]} tokens; it must have "
                             f"1..{self.seq_length} (--seq-length)")
        examples = LambadaExamples(pairs, self.seq_length, self.eod)
        return self._score([examples[i] for i in range(len(examples))])

    def loglikelihood_rolling(self, requests) -> List[float]:
        results = []
        for req in requests:
            ids = self.tokenizer.tokenize(req.args[0])
            if not ids:
                results.append(0.0)
                continue
            samples = [LambadaExamples([([self.eod], ids[:1])], self.seq_length, self.eod)[0]]
            if len(ids) > 1:
                windows = WikitextWindows(ids, self.seq_length, self.stride, self.eod, len(ids))
                samples += [windows[i] for i in range(len(windows))]
            results.append(sum(lp for lp, _ in self._score(samples)))
        return results

    def generate_until(self, requests) -> List[str]:
        return [self._generate_one(*req.args) for req in requests]

    def _generate_one(self, context: str, gen_kwargs: Dict) -> str:
        kwargs = dict(gen_kwargs or {})
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_positions = self.model.cfg.max_position_embeddings
        new_tokens = min(int(kwargs.get("max_gen_toks", 256)), max_positions - 1)
        ids = (self.tokenizer.tokenize(context) or [self.eod])[-(max_positions - new_tokens):]
        sampling = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature", 1.0)) > 0
        params = dict(temperature=float(kwargs.get("temperature", 1.0)),
                      top_k=int(kwargs.get("top_k") or 0),
                      top_p=float(kwargs.get("top_p") or 0.0)) if sampling else {"greedy": True}
        out = generate(self.model, self.tokenizer, [ids], new_tokens, **params)[0]
        return _stop_at(self.tokenizer.detokenize(out), until)


def harness_model_class():
    """The `lm_eval` model class, built on first use: lm_eval is an optional dependency."""
    from lm_eval.api.model import LM
    return type("MegatronLM", (HarnessModel, LM), {})


def get_parser():
    parser = build_parser("lm-evaluation-harness tasks on a GPT checkpoint")
    g = parser.add_argument_group("harness")
    g.add_argument("--tasks", required=True, help="comma-separated harness task names")
    g.add_argument("--include-path", default=None, help="a folder of extra YAML task files")
    g.add_argument("--num-fewshot", type=int, default=None)
    g.add_argument("--limit", type=float, default=None,
                   help="at most this many documents per task (a fraction when < 1)")
    g.add_argument("--bootstrap-iters", type=int, default=100000,
                   help="bootstrap resamples for the standard errors (0: none)")
    g.add_argument("--batch-size", dest="training.micro_batch_size", type=int,
                   default=argparse.SUPPRESS, help="alias of --micro-batch-size")
    g.add_argument("--overlapping-eval", type=int, default=None,
                   help="rolling log-likelihoods: window stride, as in tasks/main.py")
    g.add_argument("--results-json", default=None, help="write the harness's results here")
    g.add_argument("--offline", action="store_true",
                   help="never reach the Hugging Face Hub (local tasks only)")
    return parser


def task_manager(manager_class, tasks: List[str], include_path):
    """The harness's task index; the local folder alone when it defines every task asked for
    (indexing the thousands of built-in tasks takes tens of seconds)."""
    if include_path:
        local = manager_class(include_path=include_path, include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
    return manager_class(include_path=include_path)


def run_harness(lm, ns) -> Dict:
    """lm_eval's simple_evaluate over --tasks; returns its full results dict."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    tasks = [t.strip() for t in ns.tasks.split(",") if t.strip()]
    manager = task_manager(TaskManager, tasks, ns.include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        fail(f"unknown harness task(s): {', '.join(unknown)} (see lm_eval --tasks list, or add "
             f"--include-path with their YAML)")
    return simple_evaluate(model=lm, tasks=tasks, num_fewshot=ns.num_fewshot, limit=ns.limit,
                           task_manager=manager, bootstrap_iters=ns.bootstrap_iters,
                           log_samples=False)


def main(argv=None) -> Dict:
    """Evaluate; returns the harness's per-task results on rank 0 ({} on the others)."""
    config, ns, stored = parse_inference_args(get_parser(), argv, one_stage=True)
    if ns.offline:
        os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    if config.parallel.pipeline_model_parallel_size > 1:
        fail("the harness needs one pipeline stage; re-shard the checkpoint with "
             "tools/merge_mp_partitions.py --target-pipeline-model-parallel-size 1")
    seq_length = config.model.seq_length
    stride = min(32, seq_length) if ns.overlapping_eval is None else ns.overlapping_eval
    if not 1 <= stride <= seq_length:
        fail(f"--overlapping-eval ({stride}) must be in 1..{seq_length} (--seq-length)")
    try:
        model_class = harness_model_class()
    except ImportError:
        fail("the harness needs lm_eval: pip install -e \".[harness]\"")
    tokenizer = build_tokenizer_and_vocab(config, stored)
    pstate, device = initialize_distributed(config)
    try:
        models, _ = load_inference_models(config, pstate, device, vocab_size=tokenizer.vocab_size)
        lm = model_class(models[0], tokenizer, seq_length, stride,
                         config.training.micro_batch_size)
        results = run_harness(lm, ns)
    except (CheckpointError, GenerationError, ValueError) as err:
        fail(str(err).splitlines()[0])
    if results is None:  # lm_eval answers on global rank 0 only
        return {}
    from lm_eval.utils import make_table
    print(make_table(results), flush=True)
    if ns.results_json:
        with open(ns.results_json, "w", encoding="utf-8") as f:
            json.dump(results["results"], f, indent=1, default=str)
    return results["results"]


if __name__ == "__main__":
    main()
