"""A tiny byte-level GPT run (no reference data needed), shared by the reliability tests."""
import os

import numpy as np

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
from tests.conftest import ROOT


def byte_dataset(directory, docs=40, seed=0) -> str:
    """A random byte-level corpus (ids < 256, eod 256) as an MMIDIDX dataset; returns its prefix."""
    prefix = os.path.join(str(directory), "bytes_text_document")
    if not os.path.exists(prefix + ".idx"):
        rng = np.random.RandomState(seed)
        builder = MMapIndexedDatasetBuilder(prefix + ".bin", np.uint16)
        for _ in range(docs):
            builder.add_item(np.append(rng.randint(97, 123, size=rng.randint(20, 80)), 256))
            builder.end_document()
        builder.finalize(prefix + ".idx")
    return prefix


def tiny_argv(prefix, cache, *extra, iters=4, layers=2, hidden=32, heads=4, seq=16):
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads",
            str(heads), "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(iters),
            "--lr", "1e-3", "--data-path", str(prefix), "--split", "90,10,0",
            "--tokenizer-type", "ByteLevelTokenizer", "--make-vocab-size-divisible-by", "16",
            "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0",
            "--num-workers", "0", "--data-cache-path", str(cache), "--hidden-dropout", "0",
            "--attention-dropout", "0", "--use-cpu-initialization", "--seed", "1234", *map(str, extra)]


def one_thread_env():
    """Environment of a subprocess run on one thread (much faster on busy cores)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
