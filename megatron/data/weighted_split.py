"""Megatron-DeepSpeed's per-split blends: --train-weighted-split-paths and its valid/test twins.

Each flag takes groups "NAME: W1 START:END PREFIX1, W2 START:END PREFIX2, ..." (one argument
each, quoted): the split draws from the documents [round(START x n), round(END x n)) of each
prefix (n documents), blended by the weights W. This replaces --data-path/--split for that
split. Training takes one group; validation and test may take several named ones, each
evaluated and logged on its own (as Megatron-DeepSpeed's multilingual runs).
"""
import math
from typing import List, Optional, Tuple

import numpy as np

from megatron.config import ConfigError
from megatron.config.data_paths import left_to_right_sum
from megatron.data.blended_dataset import BlendedDataset
from megatron.data.gpt_dataset import GPTDataset, blended_num_samples, open_indexed_dataset

Entry = Tuple[float, float, float, str]  # weight, start, end, prefix


def parse_weighted_split_groups(flag: str, groups: List[str]) -> List[Tuple[str, List[Entry]]]:
    """[(group name, entries)] of a flag's groups (one for --train-weighted-split-paths, names
    distinct); ConfigError naming the flag when malformed."""
    if not groups or (flag.startswith("--train") and len(groups) != 1):
        raise ConfigError(f"{flag} takes one group \"NAME: W START:END PREFIX, ...\" (quoted), "
                          f"got {len(groups)}")
    parsed = [parse_weighted_split_paths(flag, [group]) for group in groups]
    names = [name for name, _ in parsed]
    if len(set(names)) != len(names):
        raise ConfigError(f"{flag}: group names must differ, got {names}")
    return parsed


def parse_weighted_split_paths(flag: str, groups: List[str]) -> Tuple[str, List[Entry]]:
    """(group name, entries) of one group; ConfigError naming the flag when malformed."""
    if len(groups) != 1:
        raise ConfigError(f"{flag} takes one group \"NAME: W START:END PREFIX, ...\" (quoted), "
                          f"got {len(groups)}")
    name, colon, body = groups[0].partition(":")
    entries = []
    for part in body.split(","):
        fields = part.split()
        try:
            weight, (start, end), prefix = float(fields[0]), map(float, fields[1].split(":")), fields[2]
        except (ValueError, IndexError):
            raise ConfigError(f"{flag}: {part.strip()!r} is not \"WEIGHT START:END PREFIX\"") from None
        if len(fields) != 3 or not math.isfinite(weight) or weight < 0 \
                or not 0.0 <= start < end <= 1.0:
            raise ConfigError(f"{flag}: {part.strip()!r} needs a finite weight >= 0 and "
                              f"0 <= START < END <= 1")
        entries.append((weight, start, end, prefix))
    if not colon or not name.strip() or left_to_right_sum(e[0] for e in entries) <= 0:
        raise ConfigError(f"{flag}: expected \"NAME: W START:END PREFIX, ...\" with a "
                          f"positive weight, got {groups[0]!r}")
    return name.strip(), entries


def build_weighted_split_dataset(split: str, name: str, entries: List[Entry], num_samples: int,
                                 seq_length: int, seed: int, data_cache_path=None,
                                 threshold: float = 0.80, vocab_size: Optional[int] = None
                                 ) -> Optional[BlendedDataset]:
    """The blended dataset of one split's group (None when it needs no samples). With
    `vocab_size`, a sample holding a token id outside the vocabulary raises DatasetError."""
    if num_samples <= 0:
        return None
    total = left_to_right_sum(e[0] for e in entries)
    weights = [e[0] / total for e in entries]
    counts = [c[0] for c in blended_num_samples(weights, (num_samples, 0, 0))]
    datasets = []
    for (_, start, end, prefix), count in zip(entries, counts):
        indexed = open_indexed_dataset(prefix)
        n = indexed.sizes.shape[0]
        documents = np.arange(int(round(start * n)), int(round(end * n)), dtype=np.int32)
        if documents.size == 0:
            raise ConfigError(f"{split} group {name}: {start}:{end} of {prefix} holds no documents")
        datasets.append(GPTDataset(f"{split}_{name}_{start:g}-{end:g}", prefix, documents, indexed,
                                   count, seq_length, seed, data_cache_path,
                                   vocab_size=vocab_size, separate_last_epoch_threshold=threshold))
    return BlendedDataset(datasets, weights, num_samples)


def weighted_split_datasets(flags, num_samples, seq_length: int, seed: int, data_cache_path,
                            threshold: float, vocab_size: Optional[int] = None):
    """(train, valid, test): each split given by its --*-weighted-split-paths flag, else None;
    a split of several groups is a dict {group name: dataset} (each of the split's size)."""
    out = []
    for split, groups, count in zip(("train", "valid", "test"), flags, num_samples):
        if not groups:
            out.append(None)
            continue
        built = {name: build_weighted_split_dataset(split, name, entries, count, seq_length,
                                                    seed, data_cache_path, threshold, vocab_size)
                 for name, entries in parse_weighted_split_groups(
                     f"--{split}-weighted-split-paths", groups)}
        out.append(next(iter(built.values())) if len(built) == 1 else built)
    return tuple(out)

