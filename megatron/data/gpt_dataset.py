"""GPT pretraining samples over an indexed dataset, with Megatron's index semantics.

A GPTDataset lays the documents of its split end to end, epoch after epoch
(each epoch's document order shuffled), and cuts the token stream into samples
of seq_length + 1 tokens; consecutive samples share one boundary token.  Three
arrays describe this and are cached as .npy files, named like Megatron's:

- doc_idx      int32  [num_epochs * num_documents]  document order
- sample_idx   int32  [num_samples + 1, 2]          (position in doc_idx, offset) of
                                                    each sample's first token
- shuffle_idx  uint32 [num_samples]                 the order samples are served in

All three come from one numpy.random.RandomState(seed), drawn in that order.
When the last epoch is used less than 80% (Megatron-LM; 95% in Megatron-DeepSpeed,
--separate-last-epoch-threshold 0.95), its documents and samples are shuffled apart
from the earlier epochs (so its partial use stays random).
"""
from __future__ import annotations

import json
import logging
import math
import os
import stat
import zlib
from functools import partial

import numpy as np
import torch

from megatron.config.data_paths import parse_data_prefix, parse_split_weights
from megatron.data import helpers
from megatron.files import write_durably, write_text_durably
from megatron.data.blended_dataset import BlendedDataset
from megatron.data.indexed_dataset import IndexedDatasetError

logger = logging.getLogger(__name__)


class DatasetError(IndexedDatasetError):
    """Data that cannot serve the run: an empty split, a token id beyond the vocabulary.

    DataLoader workers re-raise a worker's exception with its traceback in the
    message; only the original one-line message is kept."""

    def __init__(self, message: str):
        if "Original Traceback" in message:
            last = message.strip().splitlines()[-1]
            message = last.split(": ", 1)[-1]
        super().__init__(message)

SPLIT_NAMES = ("train", "valid", "test")
_BLEND_SURPLUS = 1.005  # blended per-dataset sample counts get 0.5% extra, as in Megatron
SEPARATE_LAST_EPOCH_LM = 0.80  # Megatron-LM's cutoff; Megatron-DeepSpeed's is 0.95


# ----------------------------------------------------------------------------
# Flags: --split and --data-path
# ----------------------------------------------------------------------------

def get_train_valid_test_split_(splits_string: str, size: int) -> list[int]:
    """Document boundaries [0, end_train, end_valid, size] of the three splits (Megatron's rounding)."""
    bounds = [0]
    for weight in parse_split_weights(splits_string):
        bounds.append(bounds[-1] + int(round(weight * float(size))))
    excess = bounds[-1] - size
    return [bounds[0]] + [b - excess for b in bounds[1:]]


def blended_num_samples(weights: list[float], num_samples: tuple[int, int, int]) -> list[list[int]]:
    """Per-dataset train/valid/test sample counts: ceil(n * w * 1.005)."""
    return [[int(math.ceil(n * w * _BLEND_SURPLUS)) for n in num_samples] for w in weights]


# ----------------------------------------------------------------------------
# Building the three datasets
# ----------------------------------------------------------------------------

def build_train_valid_test_datasets(data_prefix: list[str], splits_string: str,
                                    train_valid_test_num_samples: tuple[int, int, int],
                                    seq_length: int, seed: int, data_cache_path: str | None = None,
                                    vocab_size: int | None = None,
                                    separate_last_epoch_threshold: float = SEPARATE_LAST_EPOCH_LM):
    """(train, valid, test) datasets for --data-path; a split with no documents gives None.

    With `vocab_size`, a sample holding a token id >= vocab_size raises DatasetError.
    separate_last_epoch_threshold: 0.80 orders samples as Megatron-LM, 0.95 as Megatron-DeepSpeed.
    """
    build = partial(_build_prefix_datasets, seq_length=seq_length, seed=seed,
                    data_cache_path=data_cache_path, vocab_size=vocab_size,
                    threshold=separate_last_epoch_threshold)
    if len(train_valid_test_num_samples) != 3:
        raise ValueError(f"train_valid_test_num_samples must hold 3 counts, got {train_valid_test_num_samples}")
    prefixes, weights = parse_data_prefix(list(data_prefix))
    if len(prefixes) == 1:
        return build(prefixes[0], splits_string, train_valid_test_num_samples)
    per_dataset = [
        build(prefix, splits_string, counts)
        for prefix, counts in zip(prefixes, blended_num_samples(weights, train_valid_test_num_samples))
    ]
    blended = []
    for split, total in enumerate(train_valid_test_num_samples):
        parts = [(ds[split], w) for ds, w in zip(per_dataset, weights) if ds[split] is not None]
        if not parts:
            blended.append(None)
            continue
        datasets, split_weights = zip(*parts)
        blended.append(BlendedDataset(list(datasets), list(split_weights), total))
    return tuple(blended)


def open_indexed_dataset(prefix: str):
    """MMapIndexedDataset for `prefix`, with an error naming the missing file."""
    for suffix in (".idx", ".bin"):
        if not os.path.isfile(prefix + suffix):
            raise FileNotFoundError(f"--data-path prefix {prefix!r}: {prefix + suffix} not found "
                                    f"(give the path without .bin/.idx, e.g. my-gpt2_text_document)")
    from megatron.data.indexed_dataset import MMapIndexedDataset

    return MMapIndexedDataset(prefix)


def _build_prefix_datasets(prefix, splits_string, num_samples, seq_length, seed, data_cache_path,
                           vocab_size=None, threshold=SEPARATE_LAST_EPOCH_LM):
    indexed = open_indexed_dataset(prefix)
    bounds = get_train_valid_test_split_(splits_string, indexed.sizes.shape[0])
    logger.info("dataset %s: %d documents, split %s -> %s", prefix, indexed.sizes.shape[0], splits_string, bounds)
    datasets = []
    for split, name in enumerate(SPLIT_NAMES):
        if bounds[split + 1] <= bounds[split]:
            _check_empty_split_unused(prefix, splits_string, split, num_samples[split], bounds)
            datasets.append(None)
            continue
        documents = np.arange(bounds[split], bounds[split + 1], dtype=np.int32)
        datasets.append(GPTDataset(name, prefix, documents, indexed, num_samples[split],
                                   seq_length, seed, data_cache_path, vocab_size, threshold))
    return tuple(datasets)


def _check_empty_split_unused(prefix, splits_string, split, num_samples, bounds):
    """An empty valid or test split is skipped (as in Megatron); an empty train split
    when training needs samples is an error naming --split."""
    if split == 0 and num_samples > 0:
        raise DatasetError(f"--split {splits_string} leaves the train split of {prefix} without "
                           f"documents ({bounds[-1]} in all, boundaries {bounds}) but training needs "
                           f"{num_samples} samples; give it more weight or use a larger dataset")
    if num_samples > 0:
        logger.warning("--split %s leaves the %s split of %s without documents; it is skipped",
                       splits_string, SPLIT_NAMES[split], prefix)


# ----------------------------------------------------------------------------
# The dataset
# ----------------------------------------------------------------------------

class GPTDataset(torch.utils.data.Dataset):
    """Samples {"text": int64 [seq_length + 1]} cut from `documents` of `indexed_dataset`.

    `indexed_dataset` needs `sizes` (tokens per sequence) and
    `get(idx, offset=0, length=None)`; `documents` are the sequence ids of this
    split.  The index arrays are built once (by global rank 0) and cached.
    """

    def __init__(self, name: str, data_prefix: str, documents, indexed_dataset, num_samples: int,
                 seq_length: int, seed: int, data_cache_path: str | None = None,
                 vocab_size: int | None = None,
                 separate_last_epoch_threshold: float = SEPARATE_LAST_EPOCH_LM):
        documents = np.asarray(documents)
        sizes = np.asarray(indexed_dataset.sizes)
        _check_dataset_args(name, documents, sizes, num_samples, seq_length)
        _check_one_sample_per_epoch(name, data_prefix, documents, sizes, num_samples, seq_length)
        self.name = name
        self.indexed_dataset = indexed_dataset
        self.seq_length = seq_length
        self.data_prefix = data_prefix
        self.vocab_size = vocab_size
        self._cache_files = build_index_mappings(name, data_prefix, documents, sizes, num_samples,
                                                 seq_length, seed, data_cache_path,
                                                 separate_last_epoch_threshold)
        self._open()

    def _open(self) -> None:
        """Memory-map the cached index arrays and, when possible, the flat token array."""
        # Plain ndarray views of the memory maps: indexing them is cheaper than np.memmap's.
        self.doc_idx, self.sample_idx, self.shuffle_idx = (
            np.asarray(np.load(path, mmap_mode="r", allow_pickle=False)) for path in self._cache_files)
        self._len = self.sample_idx.shape[0] - 1
        self._tokens = _flat_token_view(self.indexed_dataset, self.data_prefix)
        if self._tokens is not None:
            self._pointers = np.asarray(self.indexed_dataset.pointers)
            self._sizes = np.asarray(self.indexed_dataset.sizes)
            self._itemsize = self._tokens.itemsize

    def __getstate__(self) -> dict:
        """Pickle (for spawned DataLoader workers) by file names, not by array contents."""
        state = self.__dict__.copy()
        for key in ("doc_idx", "sample_idx", "shuffle_idx", "_tokens", "_pointers", "_sizes"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, idx: int) -> dict:
        sample = self._sample(idx)
        if self.vocab_size is not None and sample["text"].size and (
                sample["text"].max() >= self.vocab_size or sample["text"].min() < 0):
            bad = sample["text"][(sample["text"] >= self.vocab_size) | (sample["text"] < 0)][0]
            raise DatasetError(f"{self.data_prefix}: {self.name} sample {idx} holds token id {bad}, "
                               f"outside the vocabulary of size {self.vocab_size}; the dataset was "
                               "made with another tokenizer (check --tokenizer-type / --vocab-file)")
        return sample

    def _sample(self, idx: int) -> dict:
        if not 0 <= idx < self._len:
            raise IndexError(f"{self.name} GPTDataset index {idx} out of range [0, {self._len})")
        i = int(self.shuffle_idx[idx])
        (doc_first, offset_first), (doc_last, offset_last) = self.sample_idx[i:i + 2].tolist()
        if self._tokens is not None:
            return {"text": self._read_flat(doc_first, offset_first, doc_last, offset_last)}
        get = self.indexed_dataset.get
        if doc_first == doc_last:
            tokens = get(int(self.doc_idx[doc_first]), offset=offset_first, length=offset_last - offset_first + 1)
            return {"text": tokens.astype(np.int64)}
        pieces = [get(int(self.doc_idx[doc_first]), offset=offset_first)]
        pieces.extend(get(doc) for doc in self.doc_idx[doc_first + 1:doc_last].tolist())
        pieces.append(get(int(self.doc_idx[doc_last]), length=offset_last + 1))
        return {"text": np.concatenate(pieces).astype(np.int64, copy=False)}

    def _read_flat(self, doc_first: int, offset_first: int, doc_last: int, offset_last: int) -> np.ndarray:
        """The sample's tokens sliced straight from the flat token array (the fast path)."""
        tokens, pointers, sizes, itemsize = self._tokens, self._pointers, self._sizes, self._itemsize
        if doc_first == doc_last:
            begin = int(pointers[self.doc_idx[doc_first]]) // itemsize + offset_first
            return tokens[begin:begin + offset_last - offset_first + 1].astype(np.int64)
        pieces = []
        for doc in self.doc_idx[doc_first:doc_last + 1].tolist():
            begin = int(pointers[doc]) // itemsize
            pieces.append(tokens[begin:begin + int(sizes[doc])])
        pieces[0] = pieces[0][offset_first:]
        pieces[-1] = pieces[-1][:offset_last + 1]
        return np.concatenate(pieces, dtype=np.int64)


def _flat_token_view(indexed_dataset, data_prefix: str):
    """The whole .bin of an MMIDIDX dataset as one token array, or None when the
    dataset is not laid out that way (then GPTDataset reads through get()).

    Slicing this array is several times cheaper than indexed_dataset.get(); the
    first and last sequences are compared with get() to be sure it is the same data.
    """
    pointers, dtype = getattr(indexed_dataset, "pointers", None), getattr(indexed_dataset, "dtype", None)
    path = data_prefix + ".bin"
    if pointers is None or dtype is None or len(pointers) == 0 or not os.path.isfile(path):
        return None
    itemsize = np.dtype(dtype).itemsize
    sizes = indexed_dataset.sizes
    chunk = 1 << 20
    if any(np.any(pointers[i:i + chunk] % itemsize) for i in range(0, len(pointers), chunk)):
        return None
    needed = int(pointers[-1]) + int(sizes[-1]) * itemsize
    if needed == 0 or os.path.getsize(path) < needed:
        return None
    tokens = np.asarray(np.memmap(path, dtype=dtype, mode="r", shape=(os.path.getsize(path) // itemsize,)))
    for seq in (0, len(sizes) - 1):
        begin = int(pointers[seq]) // itemsize
        if not np.array_equal(tokens[begin:begin + int(sizes[seq])], indexed_dataset.get(seq)):
            return None
    return tokens


def _check_dataset_args(name, documents, sizes, num_samples, seq_length):
    if documents.ndim != 1 or documents.size == 0 or not np.issubdtype(documents.dtype, np.integer):
        raise ValueError(f"{name} GPTDataset: documents must be a non-empty 1-D integer array")
    if documents.min() < 0 or documents.max() >= sizes.shape[0]:
        raise ValueError(f"{name} GPTDataset: document ids must lie in [0, {sizes.shape[0]}), "
                         f"got [{documents.min()}, {documents.max()}]")
    if seq_length < 1:
        raise ValueError(f"--seq-length must be >= 1, got {seq_length}")
    if num_samples < 0:
        raise ValueError(f"{name} GPTDataset: num_samples must be >= 0, got {num_samples}")


def _check_one_sample_per_epoch(name, data_prefix, documents, sizes, num_samples, seq_length):
    """A split whose every token does not make one sample of seq_length + 1 tokens would need
    an epoch per sample (millions, for a huge --seq-length) and serves nothing useful."""
    tokens = int(np.sum(sizes[documents], dtype=np.int64))
    if num_samples > 0 and helpers.num_samples_for(1, tokens, seq_length) < 1:
        raise DatasetError(f"--seq-length {seq_length} leaves no samples: the {name} split of "
                           f"{data_prefix} holds {tokens} tokens, too few for one sample of "
                           f"{seq_length} + 1; lower --seq-length or use more data")


# ----------------------------------------------------------------------------
# Index arrays
# ----------------------------------------------------------------------------

def num_epochs_for(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest number of epochs whose tokens give num_samples samples."""
    epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))  # ceil((n*s + 1) / t)
    while epochs > 1 and helpers.num_samples_for(epochs - 1, tokens_per_epoch, seq_length) >= num_samples:
        epochs -= 1
    while helpers.num_samples_for(epochs, tokens_per_epoch, seq_length) < num_samples:
        epochs += 1
    return epochs


def separate_last_epoch(num_epochs: int, tokens_per_epoch: int, seq_length: int, num_samples: int,
                        threshold: float = SEPARATE_LAST_EPOCH_LM) -> bool:
    """True when the last epoch is used for less than `threshold` of its samples
    (Megatron-LM: 0.80, Megatron-DeepSpeed: 0.95)."""
    if num_epochs == 1:
        return False
    from_earlier_epochs = helpers.num_samples_for(num_epochs - 1, tokens_per_epoch, seq_length)
    last_epoch_samples = num_samples - from_earlier_epochs
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    return last_epoch_samples < int(threshold * samples_per_epoch)


def build_doc_idx(documents, num_epochs: int, rng: np.random.RandomState, separate_last: bool) -> np.ndarray:
    """Documents repeated num_epochs times and shuffled (the last epoch apart if separate_last)."""
    if separate_last and num_epochs > 1:
        first = build_doc_idx(documents, num_epochs - 1, rng, False)
        last = build_doc_idx(documents, 1, rng, False)
        return np.concatenate((first, last))
    doc_idx = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(doc_idx)
    return doc_idx


def build_shuffle_idx(num_first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of range(total) that keeps [0, num_first) and [num_first, total) apart."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_first, dtype=dtype)
    rng.shuffle(first)
    if num_first == total:
        return first
    last = np.arange(num_first, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_index_arrays(documents, sizes, num_samples: int, seq_length: int, seed: int,
                       threshold: float = SEPARATE_LAST_EPOCH_LM):
    """(doc_idx, sample_idx, shuffle_idx) for the documents, computed in memory."""
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    if tokens_per_epoch < 2:
        raise ValueError(f"the {len(documents)} documents hold {tokens_per_epoch} tokens: too few for any sample")
    num_epochs = num_epochs_for(tokens_per_epoch, seq_length, num_samples)
    separate = separate_last_epoch(num_epochs, tokens_per_epoch, seq_length, num_samples, threshold)
    rng = np.random.RandomState(seed=seed)
    doc_idx = build_doc_idx(documents, num_epochs, rng, separate)
    sample_idx = helpers.build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    total = sample_idx.shape[0] - 1
    num_first = helpers.num_samples_for(num_epochs - 1, tokens_per_epoch, seq_length) if separate else total
    shuffle_idx = build_shuffle_idx(num_first, total, rng)
    logger.info("built index: %d epochs, %d samples (%d requested), separate last epoch: %s",
                num_epochs, total, num_samples, separate)
    return doc_idx, sample_idx, shuffle_idx


# ----------------------------------------------------------------------------
# The .npy cache
# ----------------------------------------------------------------------------

_ARRAY_NAMES = ("doc_idx", "sample_idx", "shuffle_idx")


def cache_file_prefix(data_prefix: str, name: str, num_samples: int, seq_length: int, seed: int,
                      data_cache_path: str | None = None) -> str:
    """`{prefix}_{name}_indexmap_{N}ns_{S}sl_{seed}s`, next to the data or under data_cache_path."""
    base = data_prefix
    if data_cache_path:
        base = os.path.join(data_cache_path, os.path.basename(data_prefix))
    return f"{base}_{name}_indexmap_{num_samples}ns_{seq_length}sl_{seed}s"


def _cache_paths(file_prefix: str) -> dict[str, str]:
    paths = {key: f"{file_prefix}_{key}.npy" for key in _ARRAY_NAMES}
    paths["desc"] = f"{file_prefix}_desc.json"
    return paths


def _describe(data_prefix, documents, sizes, num_samples, seq_length, seed,
              threshold=SEPARATE_LAST_EPOCH_LM) -> dict:
    """What the cached arrays depend on; a cache with another description is stale."""
    docs = np.ascontiguousarray(documents, dtype=np.int64)
    return {
        "dataset": os.path.basename(data_prefix),
        "num_sequences": int(sizes.shape[0]),
        "num_documents": int(docs.size),
        "documents_crc32": zlib.crc32(docs.tobytes()),
        "tokens_per_epoch": int(np.sum(sizes[docs], dtype=np.int64)),
        "num_samples": int(num_samples),
        "seq_length": int(seq_length),
        "seed": int(seed),
        "separate_last_epoch_threshold": float(threshold),
    }


def _cache_state(paths: dict[str, str], desc: dict) -> str:
    """'valid', 'missing' or 'stale'.  Caches without a description (Megatron's) are trusted."""
    if not all(os.path.isfile(paths[key]) for key in _ARRAY_NAMES):
        return "missing"
    if not os.path.isfile(paths["desc"]):
        return "valid"
    try:
        with open(paths["desc"]) as f:
            return "valid" if json.load(f) == desc else "stale"
    except (OSError, ValueError):
        return "stale"


def _dir_is_writable(directory: str) -> bool:
    """False for read-only mounts, missing permission, and directories with no write bit at all."""
    try:
        mode = os.stat(directory).st_mode
    except OSError:
        return False
    return bool(stat.S_IMODE(mode) & 0o222) and os.access(directory, os.W_OK)


def _check_cache_dir(file_prefix: str, data_cache_path: str | None) -> None:
    directory = os.path.dirname(os.path.abspath(file_prefix))
    if data_cache_path:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError:
            pass  # reported just below
        if not _dir_is_writable(directory):
            raise PermissionError(f"--data-cache-path {data_cache_path} is not writable; give a writable directory")
    elif not _dir_is_writable(directory):
        raise PermissionError(f"cannot write the dataset index cache in {directory} (read-only); "
                              f"pass --data-cache-path DIR to keep it elsewhere")


def _write_cache(paths, arrays, desc) -> None:
    for key, array in zip(_ARRAY_NAMES, arrays):
        write_durably(paths[key], lambda f, a=array: np.save(f, a, allow_pickle=False))
    # The description goes last: a cache with arrays but no matching description gets rebuilt.
    write_text_durably(paths["desc"], json.dumps(desc, indent=1))


def _build_cache_if_needed(paths, desc, data_cache_path, file_prefix, build) -> None:
    state = _cache_state(paths, desc)
    if state == "valid":
        return
    _check_cache_dir(file_prefix, data_cache_path)
    if state == "stale":
        logger.warning("dataset index cache %s does not match this dataset/split; rebuilding it", file_prefix)
    _write_cache(paths, build(), desc)


def _distributed_rank() -> tuple[int, bool]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), True
    return 0, False


def build_index_mappings(name, data_prefix, documents, sizes, num_samples, seq_length, seed,
                         data_cache_path=None, threshold=SEPARATE_LAST_EPOCH_LM):
    """Build (on global rank 0) or find the cached index arrays; returns the paths of the
    doc_idx, sample_idx and shuffle_idx .npy files, which every rank then memory-maps."""
    file_prefix = cache_file_prefix(data_prefix, name, num_samples, seq_length, seed, data_cache_path)
    paths = _cache_paths(file_prefix)
    desc = _describe(data_prefix, documents, sizes, num_samples, seq_length, seed, threshold)
    rank, distributed = _distributed_rank()
    error = None
    if rank == 0:
        try:
            _build_cache_if_needed(paths, desc, data_cache_path, file_prefix,
                                   lambda: build_index_arrays(documents, sizes, num_samples, seq_length, seed,
                                                              threshold))
        except Exception as exc:  # re-raised below, after the barrier, so no rank hangs
            error = exc
    if distributed:
        torch.distributed.barrier()
    if error is not None:
        raise error
    if _cache_state(paths, desc) != "valid":
        raise RuntimeError(f"rank {rank}: no valid dataset index cache at {file_prefix}_*.npy after rank 0 "
                           f"built it; see rank 0's error, and check that the cache directory is shared by all nodes")
    return tuple(paths[key] for key in _ARRAY_NAMES)
