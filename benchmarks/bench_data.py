"""Benchmarks of the GPT data path, on synthetic data in a temporary directory.

(a) sample-index build for 10 million samples over 1 million documents: the C++
    helper beside the numpy fallback (same arrays).  Target: C++ < 2 s.
(b) random samples of seq_length + 1 tokens read through GPTDataset, against
    slicing a raw np.memmap of the .bin at the same number of random places.
    Target: ratio <= 2.

Run from the repository root: python benchmarks/bench_data.py [--quick]
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data import helpers  # noqa: E402
from megatron.data.gpt_dataset import GPTDataset, build_doc_idx, num_epochs_for  # noqa: E402


def bench_sample_idx(num_docs: int, num_samples: int, seq_length: int) -> None:
    rng = np.random.RandomState(0)
    sizes = rng.randint(1, 2 * seq_length, size=num_docs).astype(np.int32)
    tokens_per_epoch = int(sizes.sum(dtype=np.int64))
    epochs = num_epochs_for(tokens_per_epoch, seq_length, num_samples)
    doc_idx = build_doc_idx(np.arange(num_docs, dtype=np.int32), epochs, rng, False)
    print(f"(a) sample index: {num_docs:,} documents, {epochs} epochs, doc_idx {len(doc_idx):,}, "
          f"seq_length {seq_length}, >= {num_samples:,} samples")
    module = helpers.load_cpp_helpers()
    if module is None:
        print("    C++ helpers unavailable; only the fallback is timed")
    else:
        t0 = time.perf_counter()
        cpp = helpers.build_sample_idx(sizes, doc_idx, seq_length, epochs, tokens_per_epoch)
        t_cpp = time.perf_counter() - t0
        print(f"    C++    : {t_cpp:7.3f} s  ({cpp.shape[0] - 1:,} samples, {cpp.dtype})  target < 2 s")
    t0 = time.perf_counter()
    ref = helpers.build_sample_idx_numpy(sizes, doc_idx, seq_length, epochs, tokens_per_epoch)
    t_np = time.perf_counter() - t0
    print(f"    numpy  : {t_np:7.3f} s")
    if module is not None:
        same = cpp.dtype == ref.dtype and np.array_equal(cpp, ref)
        print(f"    identical arrays: {same}; numpy / C++ = {t_np / t_cpp:.1f}x")
        if not same:
            raise SystemExit("C++ and numpy sample indices differ")


def _write_dataset(prefix: str, num_docs: int, seq_length: int) -> None:
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    rng = np.random.RandomState(1)
    lengths = rng.randint(1, 2 * seq_length, size=num_docs)
    tokens = rng.randint(0, 50000, size=int(lengths.sum())).astype(np.uint16)
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_docs(tokens, lengths, np.ones(num_docs, dtype=np.int64))
    builder.finalize(prefix + ".idx")


def _time_reads(read, indices) -> float:
    """Best of 5 passes, in CPU seconds of this process per read (steadier on a busy machine)."""
    best = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        for i in indices:
            read(i)
        best = min(best, time.process_time() - t0)
    return best / len(indices)


def bench_reads(num_docs: int, seq_length: int, reads: int) -> None:
    from megatron.data.indexed_dataset import MMapIndexedDataset

    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "synthetic_text_document")
        _write_dataset(prefix, num_docs, seq_length)
        indexed = MMapIndexedDataset(prefix)
        total_tokens = int(indexed.sizes.sum(dtype=np.int64))
        dataset = GPTDataset("train", prefix, np.arange(num_docs, dtype=np.int32), indexed,
                             num_samples=2 * reads, seq_length=seq_length, seed=1234)
        raw = np.memmap(prefix + ".bin", dtype=np.uint16, mode="r")
        rng = np.random.RandomState(2)
        sample_ids = rng.randint(0, len(dataset), size=reads)
        starts = rng.randint(0, total_tokens - seq_length - 1, size=reads)
        width = seq_length + 1
        for i in sample_ids[:100]:  # the dataset returns what the raw slice would
            assert dataset[i]["text"].shape == (width,) and dataset[i]["text"].dtype == np.int64
        t_raw = _time_reads(lambda s: np.array(raw[s:s + width], dtype=np.int64), starts)
        t_ds = _time_reads(lambda i: dataset[i], sample_ids)
        print(f"(b) random reads of {width} tokens, {reads:,} reads, {num_docs:,} documents "
              f"({total_tokens:,} tokens, mean document {total_tokens / num_docs:.0f} tokens)")
        print(f"    raw np.memmap slice : {t_raw * 1e6:7.2f} us/sample (CPU time)")
        print(f"    GPTDataset[i]       : {t_ds * 1e6:7.2f} us/sample (CPU time)")
        print(f"    ratio               : {t_ds / t_raw:7.2f}x  target <= 2x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10x smaller sizes, for a smoke run")
    args = parser.parse_args()
    scale = 10 if args.quick else 1
    bench_sample_idx(num_docs=1_000_000 // scale, num_samples=10_000_000 // scale, seq_length=1024)
    bench_reads(num_docs=20_000 // scale, seq_length=1024, reads=20_000 // scale)


if __name__ == "__main__":
    main()
