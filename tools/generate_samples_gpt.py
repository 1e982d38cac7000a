"""Sample text from a GPT checkpoint.

    python tools/generate_samples_gpt.py --load CKPT \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --prompt "The meaning of life is" --out-seq-length 64 --top_k 40 --temperature 0.9

Model flags (--num-layers, --hidden-size, ...) and tokenizer flags may be left
out: they are read from the checkpoint's stored config; flags given win.
Prompts come from --prompt (repeatable) and --sample-input-file (one prompt per
line); each continuation is printed as "Context: ... / Megatron-LM: ..." and
written to --sample-output-file in that form. Without prompts, --num-samples N
draws N unconditional samples (starting from end-of-document), written as JSON
lines {"text", "length", "finished"}. --out-seq-length is the most new tokens
per sample. The layout is the checkpoint's unless --tensor-model-parallel-size is given:
run under torchrun with its TP (a pipeline-parallel checkpoint runs as one stage, its
stages merged in memory; extra processes are data-parallel replicas); in one process, or
with another TP, the weights are re-sharded in memory.
"""
import json
import os
import sys
import time
from typing import Dict, List

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import torch.distributed as dist  # noqa: E402

from megatron.arguments import build_parser, fail  # noqa: E402
from megatron.text_generation import GenerationError, SamplingParams, generate  # noqa: E402
from megatron.training.checkpoint_setup import (build_tokenizer_and_vocab,  # noqa: E402
                                            load_inference_models, parse_inference_args)
from megatron.checkpointing.io import CheckpointError  # noqa: E402
from megatron.files import write_text_durably  # noqa: E402
from megatron.training.initialize import initialize_distributed  # noqa: E402


def get_parser():
    parser = build_parser("Sample text from a GPT checkpoint")
    g = parser.add_argument_group("text generation")
    g.add_argument("--out-seq-length", type=int, default=1024,
                   help="most new tokens per sample (also capped by --max-position-embeddings)")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top_k", "--top-k", dest="top_k", type=int, default=0,
                   help="sample among the k most likely tokens (0: off)")
    g.add_argument("--top_p", "--top-p", dest="top_p", type=float, default=0.0,
                   help="nucleus sampling threshold (0: off)")
    g.add_argument("--greedy", action="store_true", help="always take the most likely token")
    g.add_argument("--recompute", action="store_true",
                   help="no KV cache: recompute the whole sequence for every new token (Megatron's flag)")
    g.add_argument("--sample-input-file", default=None, help="prompts, one per line")
    g.add_argument("--sample-output-file", "--genfile", dest="sample_output_file", default=None)
    g.add_argument("--num-samples", type=int, default=0,
                   help="unconditional samples to draw when no prompt is given")
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    return parser


def read_prompts(ns) -> List[str]:
    prompts = list(ns.prompt)
    if ns.sample_input_file:
        try:
            with open(ns.sample_input_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as err:
            fail(f"cannot read --sample-input-file {ns.sample_input_file}: {err.strerror}")
    return prompts


def check_flags(ns, prompts: List[str]) -> SamplingParams:
    if ns.out_seq_length < 1:
        fail(f"--out-seq-length must be >= 1, got {ns.out_seq_length}")
    if ns.num_samples < 0:
        fail(f"--num-samples must be >= 0, got {ns.num_samples}")
    if prompts and ns.num_samples:
        fail("give prompts (--prompt / --sample-input-file) or --num-samples, not both")
    if not prompts and not ns.num_samples:
        fail("nothing to generate: give --prompt, --sample-input-file or --num-samples N")
    try:
        return SamplingParams(greedy=ns.greedy, top_k=ns.top_k, top_p=ns.top_p,
                              temperature=ns.temperature)
    except ValueError as err:
        fail(str(err).replace("top_k", "--top_k").replace("top_p", "--top_p"))


def sample_all(model, tokenizer, prompts: List[str], ns, params: SamplingParams, config
               ) -> List[Dict]:
    """Generate for every prompt in batches of --micro-batch-size, with a progress line per
    batch (samples done, new tokens per second)."""
    batch_size = config.training.micro_batch_size
    max_positions = config.model.max_position_embeddings
    records, started, capped = [], time.time(), False
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        longest = max(max(len(tokenizer.tokenize(p)), 1) for p in batch)
        if longest >= max_positions:
            raise GenerationError(f"a prompt has {longest} tokens; the model takes at most "
                                  f"{max_positions} positions (--max-position-embeddings)")
        new_tokens = min(ns.out_seq_length, max_positions - longest)
        if new_tokens < ns.out_seq_length and not capped:
            capped = True
            _say(f" > --out-seq-length {ns.out_seq_length} exceeds the position limit: a prompt "
                 f"and its continuation share --max-position-embeddings ({max_positions}) "
                 f"positions, so a sample gets at most {max_positions} minus its batch's "
                 f"longest prompt new tokens ({new_tokens} here)")
        outputs = generate(model, tokenizer, batch, new_tokens, greedy=params.greedy,
                           top_k=params.top_k, top_p=params.top_p,
                           temperature=params.temperature, seed=config.training.seed + start,
                           use_cache=not ns.recompute)
        for prompt, ids in zip(batch, outputs):
            records.append({"prompt": prompt, "text": tokenizer.detokenize(ids), "tokens": ids,
                            "finished": len(ids) < new_tokens})
        rate = sum(len(r["tokens"]) for r in records) / max(time.time() - started, 1e-9)
        _say(f" generated {len(records)}/{len(prompts)} samples | {rate:.1f} tokens/s")
    return records


def _say(line: str) -> None:
    """A progress or notice line on stderr (stdout holds the samples), from rank 0."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, file=sys.stderr, flush=True)


def format_records(records: List[Dict], unconditional: bool) -> str:
    if unconditional:
        return "".join(json.dumps({"text": r["text"], "length": len(r["tokens"]),
                                   "finished": r["finished"]}) + "\n" for r in records)
    return "".join(f"\nContext: {r['prompt']}\n\nMegatron-LM: {r['text']}\n" for r in records)


def main(argv=None) -> List[Dict]:
    """Run the tool; returns the records (prompt, text, tokens, finished)."""
    parser = get_parser()
    config, ns, stored = parse_inference_args(parser, argv, one_stage=True)
    prompts = read_prompts(ns)
    params = check_flags(ns, prompts)
    if config.parallel.pipeline_model_parallel_size > 1:
        fail("generation runs whole models: drop --pipeline-model-parallel-size (a "
             "pipeline-parallel checkpoint is merged to one stage in memory)")
    tokenizer = build_tokenizer_and_vocab(config, stored)
    pstate, device = initialize_distributed(config)
    unconditional = not prompts
    try:
        models, _ = load_inference_models(config, pstate, device, vocab_size=tokenizer.vocab_size)
        records = sample_all(models[0], tokenizer, prompts or [""] * ns.num_samples, ns, params,
                             config)
    except (CheckpointError, GenerationError) as err:
        fail(str(err))
    if not dist.is_initialized() or dist.get_rank() == 0:
        text = format_records(records, unconditional)
        print(text, flush=True)
        if ns.sample_output_file:
            write_text_durably(ns.sample_output_file, text)
            print(f" wrote {len(records)} samples to {ns.sample_output_file}", flush=True)
    return records


if __name__ == "__main__":
    main()
