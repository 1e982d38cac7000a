"""Synthetic GPT samples (--mock-data): random tokens, no files; the fastest way to benchmark a layout."""
import numpy as np


class MockGPTDataset:
    """`num_samples` samples of seq_length + 1 token ids in [0, vocab_size), each drawn from
    its own generator (seed, split, index): the same sample at any layout and worker count."""

    def __init__(self, split: int, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        if num_samples < 0 or seq_length < 1 or vocab_size < 1:
            raise ValueError(f"mock data needs samples >= 0, seq length >= 1 and a vocabulary, got "
                             f"{num_samples}, {seq_length}, {vocab_size}")
        self.split, self.num_samples = split, num_samples
        self.seq_length, self.vocab_size, self.seed = seq_length, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"mock dataset index {idx} out of range [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, self.split, idx])
        return {"text": rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)}


def build_mock_datasets(num_samples, seq_length: int, vocab_size: int, seed: int):
    """(train, valid, test) mock datasets of the requested sizes (None for an empty split)."""
    return tuple(MockGPTDataset(split, n, seq_length, vocab_size, seed) if n > 0 else None
                 for split, n in enumerate(num_samples))
