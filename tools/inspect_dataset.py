"""Summarise a preprocessed MMIDIDX dataset and show its first document.

    python tools/inspect_dataset.py my-gpt2_text_document \\
        [--tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt]

Prints the dtype, document / sequence / token counts, sequence-length
statistics, and the first ``--max-tokens`` ids of document ``--doc`` (decoded to
text when a tokenizer is given).
"""
import argparse
import os
import sys

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import numpy as np  # noqa: E402

from megatron.data.indexed_dataset import MMapIndexedDataset  # noqa: E402
from megatron.tokenizer import build_tokenizer, TOKENIZER_TYPES  # noqa: E402


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("prefix", help="dataset prefix (without .bin/.idx)")
    parser.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                        help="decode the sample (GPT2BPETokenizer when --vocab-file is given)")
    parser.add_argument("--vocab-file", default=None)
    parser.add_argument("--merge-file", default=None)
    parser.add_argument("--tokenizer-name-or-path", default=None)
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--doc", type=int, default=0, help="document to show")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens of it to show")
    return parser.parse_args(argv)


def summary(dataset: MMapIndexedDataset) -> str:
    sizes = dataset.sizes
    lines = [f"dtype: {np.dtype(dataset.dtype).name}",
             f"documents: {len(dataset.doc_idx) - 1}",
             f"sequences: {len(dataset)}",
             f"tokens: {int(sizes.sum(dtype=np.int64))}"]
    if len(sizes):
        lines.append(f"sequence length: min {int(sizes.min())}, mean {sizes.mean():.1f}, "
                     f"max {int(sizes.max())}")
    return "\n".join(lines)


def sample(dataset: MMapIndexedDataset, doc: int, max_tokens: int, tokenizer=None) -> str:
    """The first ``max_tokens`` ids of document ``doc`` (and their text)."""
    documents = len(dataset.doc_idx) - 1
    if not 0 <= doc < documents:
        raise ValueError(f"--doc {doc} is out of range: the dataset has {documents} documents")
    first, last = int(dataset.doc_idx[doc]), int(dataset.doc_idx[doc + 1])
    ids = np.concatenate([dataset[i] for i in range(first, last)] or [np.zeros(0, np.int64)])
    shown = ids[:max_tokens].tolist()
    lines = [f"document {doc}: {len(ids)} tokens in {last - first} sequences; "
             f"first {len(shown)} ids:", str(shown)]
    if tokenizer is not None:
        lines += ["decoded:", repr(tokenizer.detokenize(shown))]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = get_args(argv)
    tokenizer_type = args.tokenizer_type or ("GPT2BPETokenizer" if args.vocab_file else None)
    try:
        dataset = MMapIndexedDataset(args.prefix)
        tokenizer = None
        if tokenizer_type:
            tokenizer = build_tokenizer(tokenizer_type, args.vocab_file, args.merge_file,
                                        args.tokenizer_name_or_path, args.vocab_size)
        print(f"dataset: {args.prefix}")
        print(summary(dataset))
        print(sample(dataset, args.doc, args.max_tokens, tokenizer))
    except (ValueError, OSError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
