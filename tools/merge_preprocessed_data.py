"""Concatenate preprocessed MMIDIDX datasets into one.

    python tools/merge_preprocessed_data.py --datasets a_text_document b_text_document \\
        --output-prefix ab_text_document

Documents keep their order (all of A, then all of B, ...); the document index is
offset so the result equals preprocessing the concatenated inputs. All inputs
must share a dtype. Output is written under temporary names, then renamed.
"""
import argparse
import os
import sys

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import numpy as np  # noqa: E402

from megatron.data.indexed_dataset import (data_file_path, index_file_path,  # noqa: E402
                                           MMapIndexedDataset, MMapIndexedDatasetBuilder)


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", nargs="+", required=True,
                        help="dataset prefixes (without .bin/.idx), merged in this order")
    parser.add_argument("--output-prefix", required=True,
                        help="prefix of the merged dataset (without .bin/.idx)")
    return parser.parse_args(argv)


def check_inputs(prefixes, output_prefix: str) -> np.dtype:
    """Open every input once (format errors surface here); returns their common dtype."""
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    if not os.path.isdir(out_dir):
        raise ValueError(f"--output-prefix: directory {out_dir} does not exist; create it first")
    dtypes = {}
    for prefix in prefixes:
        if os.path.abspath(prefix) == os.path.abspath(output_prefix):
            raise ValueError(f"--output-prefix {output_prefix} is also an input; pick a new name")
        dtypes[prefix] = np.dtype(MMapIndexedDataset(prefix).dtype)
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{p}: {d.name}" for p, d in dtypes.items())
        raise ValueError(f"--datasets have different dtypes ({listing}); re-run "
                         "preprocessing with one tokenizer")
    return next(iter(dtypes.values()))


def merge_datasets(prefixes, output_prefix: str) -> MMapIndexedDataset:
    """Write ``output_prefix``.bin/.idx holding every input in order."""
    dtype = check_inputs(prefixes, output_prefix)
    builder = MMapIndexedDatasetBuilder(data_file_path(output_prefix), dtype)
    try:
        for prefix in prefixes:
            builder.merge_file_(prefix)
        builder.finalize(index_file_path(output_prefix))
    except BaseException:
        builder.abort()
        raise
    return MMapIndexedDataset(output_prefix)


def main(argv=None) -> int:
    args = get_args(argv)
    try:
        merged = merge_datasets(args.datasets, args.output_prefix)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"Merged {len(args.datasets)} datasets into {args.output_prefix}: "
          f"{len(merged.doc_idx) - 1} documents, {len(merged)} sequences, "
          f"{int(merged.sizes.sum())} tokens", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
