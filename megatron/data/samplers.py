"""Batch samplers for pretraining that resume from a count of consumed samples.

Both samplers cut the sample stream into global chunks of
micro_batch_size * data_parallel_size samples; data-parallel rank r takes the
r-th micro batch of each chunk.  So the samples seen by all ranks together do not
depend on the data-parallel size, and resuming from `consumed_samples` (a multiple
of the chunk) continues exactly where an uninterrupted run would be.
"""
from __future__ import annotations

import signal
import weakref
from typing import Iterable, Iterator, Optional

import torch

from megatron.data.sample_record import RecordedSampler
from megatron.lifetime import die_with_parent

_OPEN_ITERATORS: "weakref.WeakSet" = weakref.WeakSet()


class _ChunkedSampler:
    """What both samplers share: the checked arguments and the global chunk."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        if total_samples <= 0:
            raise ValueError(f"sampler: no samples to draw from (total_samples={total_samples})")
        if consumed_samples < 0:
            raise ValueError(f"sampler: consumed_samples must be >= 0, got {consumed_samples}")
        if micro_batch_size <= 0:
            raise ValueError(f"--micro-batch-size must be > 0, got {micro_batch_size}")
        if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data-parallel rank {data_parallel_rank} is not in [0, {data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.global_chunk = micro_batch_size * data_parallel_size

    @property
    def rank_offset(self) -> int:
        """Where this rank's micro batch starts inside a global chunk."""
        return self.data_parallel_rank * self.micro_batch_size


class MegatronPretrainingSampler(_ChunkedSampler):
    """Samples consumed_samples, consumed_samples + 1, ... in order ('single' pass)."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True):
        super().__init__(total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
                         data_parallel_size)
        if consumed_samples >= total_samples:
            raise ValueError(f"sampler: all {total_samples} samples are already consumed "
                             f"(consumed_samples={consumed_samples}); build the dataset with more samples")
        self.drop_last = drop_last

    def __len__(self) -> int:
        """Micro batches this rank will yield."""
        remaining = self.total_samples - self.consumed_samples
        full, rest = divmod(remaining, self.global_chunk)
        return full + (0 if self.drop_last or rest <= self.rank_offset else 1)

    def __iter__(self) -> Iterator[list[int]]:
        start = self.rank_offset
        for chunk_start in range(self.consumed_samples, self.total_samples, self.global_chunk):
            chunk_end = min(chunk_start + self.global_chunk, self.total_samples)
            if chunk_end - chunk_start < self.global_chunk and self.drop_last:
                return
            batch = list(range(chunk_start + start, min(chunk_start + start + self.micro_batch_size, chunk_end)))
            if batch:
                yield batch


class MegatronPretrainingRandomSampler(_ChunkedSampler):
    """Epochs of freshly shuffled samples ('cyclic'); each `iter()` runs to the end of an epoch.

    Epoch e uses a permutation of all samples seeded with seed + e and serves its
    first total_samples - total_samples % (micro_batch_size * dp) entries.
    `consumed_samples` advances as batches are yielded, so iterating again
    continues with the next epoch (use `cyclic_iter` for an endless stream).
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, seed: int = 1234):
        super().__init__(total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
                         data_parallel_size)
        self.samples_per_epoch = total_samples - total_samples % self.global_chunk
        if self.samples_per_epoch == 0:
            raise ValueError(f"sampler: {total_samples} samples are fewer than one global chunk of "
                             f"micro_batch_size * data_parallel_size = {self.global_chunk}")
        if consumed_samples % self.global_chunk:
            raise ValueError(f"sampler: consumed_samples={consumed_samples} is not a multiple of "
                             f"micro_batch_size * data_parallel_size = {self.global_chunk}")
        self.seed = seed

    def __len__(self) -> int:
        """Micro batches this rank yields per epoch."""
        return self.samples_per_epoch // self.global_chunk

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The samples of `epoch` in the order all ranks together consume them."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(self.total_samples, generator=generator)[: self.samples_per_epoch]

    def __iter__(self) -> Iterator[list[int]]:
        epoch, offset = divmod(self.consumed_samples, self.samples_per_epoch)
        order = self.epoch_order(epoch)
        start = self.rank_offset
        for chunk_start in range(offset, self.samples_per_epoch, self.global_chunk):
            batch = order[chunk_start + start: chunk_start + start + self.micro_batch_size].tolist()
            self.consumed_samples += self.global_chunk
            yield batch


def cyclic_iter(iterable: Iterable) -> Iterator:
    """Iterate `iterable` again and again (for the 'cyclic' data loader)."""
    while True:
        yield from iterable


def build_pretraining_data_loader(dataset, consumed_samples: int, micro_batch_size: int,
                                  data_parallel_rank: int, data_parallel_size: int,
                                  dataloader_type: str = "single", num_workers: int = 0,
                                  seed: int = 1234, drop_last: bool = True,
                                  record_to: Optional[str] = None):
    """A DataLoader of {"text": LongTensor [micro_batch_size, seq_length + 1]} for this DP rank.

    'single': one ordered pass from consumed_samples; 'cyclic': shuffled epochs
    (wrap the loader in `cyclic_iter` to run past the end of an epoch).
    Returns None when `dataset` is None. `record_to`: a file that gets each micro batch's
    sample indices (megatron/data/sample_record.py).
    """
    if dataset is None:
        return None
    common = dict(total_samples=len(dataset), consumed_samples=consumed_samples,
                  micro_batch_size=micro_batch_size, data_parallel_rank=data_parallel_rank,
                  data_parallel_size=data_parallel_size)
    if dataloader_type == "single":
        sampler = MegatronPretrainingSampler(**common, drop_last=drop_last)
    elif dataloader_type == "cyclic":
        sampler = MegatronPretrainingRandomSampler(**common, seed=seed)
    else:
        raise ValueError(f"--dataloader-type {dataloader_type!r} is not supported; use 'single' or 'cyclic'")
    if num_workers < 0:
        raise ValueError(f"--num-workers must be >= 0, got {num_workers}")
    if record_to:
        sampler = RecordedSampler(sampler, record_to)
    return _ClosableLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                           pin_memory=torch.cuda.is_available(),
                           persistent_workers=num_workers > 0,
                           worker_init_fn=_leave_sigterm_to_the_trainer)


class _ClosableLoader(torch.utils.data.DataLoader):
    """A DataLoader whose open iterators `close_loaders` can shut down from an exit path."""

    def __iter__(self):
        iterator = super().__iter__()
        if self.num_workers > 0:
            _OPEN_ITERATORS.add(iterator)
        return iterator


def close_loaders() -> None:
    """Stop the workers of every open loader iterator (what the iterator does when it is
    garbage-collected; at an error exit it may still be referenced by the traceback)."""
    for iterator in list(_OPEN_ITERATORS):
        shutdown = getattr(iterator, "_shutdown_workers", None)  # torch's own shutdown
        if shutdown is not None:
            shutdown()
    _OPEN_ITERATORS.clear()


def _leave_sigterm_to_the_trainer(worker_id: int) -> None:
    """Loader workers ignore SIGTERM. SLURM and torchrun send it to the whole process
    group; it is the training process's to handle (--exit-signal-handler saves first),
    and the workers still end with it (megatron.training.children shuts them down at
    every exit). On Linux a worker is also killed when its parent dies (SIGKILL, OOM),
    so no worker outlives the run."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent()
