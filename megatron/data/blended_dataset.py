"""A weighted mix of datasets, interleaved deterministically (Megatron's BlendableDataset)."""
from __future__ import annotations

import numpy as np
import torch

from megatron.data import helpers


class BlendedDataset(torch.utils.data.Dataset):
    """`size` samples drawn from `datasets` in proportion to `weights`.

    Sample i comes from dataset `dataset_index[i]`, as its
    `dataset_sample_index[i]`-th sample; every prefix of the blend follows the
    weights as closely as whole samples allow (see helpers.build_blending_indices).
    """

    def __init__(self, datasets: list, weights: list[float], size: int):
        _check_args(datasets, weights, size)
        self.datasets = list(datasets)
        self.size = int(size)
        normalised = np.asarray(weights, dtype=np.float64)
        normalised = normalised / normalised.sum()
        self.weights = normalised
        self.dataset_index = np.zeros(self.size, dtype=np.uint8)
        self.dataset_sample_index = np.zeros(self.size, dtype=np.int64)
        helpers.build_blending_indices(self.dataset_index, self.dataset_sample_index,
                                       normalised, len(self.datasets), self.size)
        self._check_datasets_long_enough()

    def _check_datasets_long_enough(self) -> None:
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for d, (needed, dataset) in enumerate(zip(counts, self.datasets)):
            if needed > len(dataset):
                raise ValueError(f"blended dataset needs {needed} samples from dataset {d} "
                                 f"(weight {self.weights[d]:.4f}) but it has only {len(dataset)}; "
                                 f"build it with more samples (the builder adds 0.5%)")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int):
        if not 0 <= idx < self.size:
            raise IndexError(f"BlendedDataset index {idx} out of range [0, {self.size})")
        dataset = self.dataset_index[idx]
        return self.datasets[dataset][int(self.dataset_sample_index[idx])]


def _check_args(datasets, weights, size) -> None:
    if not datasets:
        raise ValueError("BlendedDataset needs at least one dataset")
    if len(datasets) > 256:
        raise ValueError(f"BlendedDataset supports at most 256 datasets, got {len(datasets)}")
    if len(weights) != len(datasets):
        raise ValueError(f"BlendedDataset got {len(weights)} weights for {len(datasets)} datasets")
    if any(not np.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"BlendedDataset weights {list(weights)} must be non-negative with a positive sum")
    if size < 0:
        raise ValueError(f"BlendedDataset size must be >= 0, got {size}")
