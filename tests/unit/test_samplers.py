"""Pretraining samplers and the data loader: DP layout, resumption, batches."""
import itertools

import numpy as np
import pytest
import torch

from megatron.data.samplers import (MegatronPretrainingRandomSampler, MegatronPretrainingSampler,
                                    build_pretraining_data_loader, cyclic_iter)


class Tagged(torch.utils.data.Dataset):
    """Sample i is {"text": [i, i, ..., i]} of seq_length + 1 tokens."""

    def __init__(self, n, seq_length=4):
        self.n, self.seq_length = n, seq_length

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"text": np.full(self.seq_length + 1, i, dtype=np.int64)}


def merged_global_batches(make_sampler, dp, steps=None):
    """Per step, the concatenation of every DP rank's micro batch."""
    per_rank = [list(make_sampler(rank, dp)) for rank in range(dp)]
    if steps is None:
        assert len({len(batches) for batches in per_rank}) == 1
        steps = len(per_rank[0])
    return [sum((per_rank[r][s] for r in range(dp)), []) for s in range(steps)]


def test_sequential_layout_and_dp_invariance():
    sampler = MegatronPretrainingSampler(10, 0, 2, 0, 1)
    assert list(sampler) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert list(MegatronPretrainingSampler(10, 0, 2, 1, 2)) == [[2, 3], [6, 7]]  # 8, 9 dropped
    one = merged_global_batches(lambda r, dp: MegatronPretrainingSampler(37, 5, 4, r, dp), 1)
    two = merged_global_batches(lambda r, dp: MegatronPretrainingSampler(37, 5, 2, r, dp), 2)
    assert one == two and sum(one, []) == list(range(5, 37))[:32]


def test_sequential_resume_and_last_batch():
    full = list(MegatronPretrainingSampler(50, 0, 3, 1, 2))
    for done in range(len(full)):
        resumed = list(MegatronPretrainingSampler(50, done * 6, 3, 1, 2))
        assert resumed == full[done:]
    keep = MegatronPretrainingSampler(10, 0, 3, 0, 2, drop_last=False)
    assert list(keep) == [[0, 1, 2], [6, 7, 8]] and len(keep) == 2
    assert list(MegatronPretrainingSampler(10, 0, 3, 1, 2, drop_last=False)) == [[3, 4, 5], [9]]
    assert len(MegatronPretrainingSampler(50, 6, 3, 1, 2)) == len(full) - 1


def test_sampler_argument_errors():
    with pytest.raises(ValueError, match="already consumed"):
        MegatronPretrainingSampler(10, 10, 2, 0, 1)
    with pytest.raises(ValueError, match="rank 2"):
        MegatronPretrainingSampler(10, 0, 2, 2, 2)
    with pytest.raises(ValueError, match="micro-batch-size"):
        MegatronPretrainingRandomSampler(10, 0, 0, 0, 1)
    with pytest.raises(ValueError, match="multiple"):
        MegatronPretrainingRandomSampler(10, 3, 2, 0, 1)
    with pytest.raises(ValueError, match="fewer than one global chunk"):
        MegatronPretrainingRandomSampler(3, 0, 2, 0, 2)


def test_random_sampler_epochs():
    sampler = MegatronPretrainingRandomSampler(23, 0, 2, 0, 2, seed=5)  # 20 samples per epoch
    epoch0 = list(sampler)
    assert len(epoch0) == len(sampler) == 5 and sampler.consumed_samples == 20
    epoch1 = list(sampler)  # iterating again continues with the next epoch
    flat0, flat1 = sum(epoch0, []), sum(epoch1, [])
    assert flat0 != flat1 and len(set(flat0)) == 10 and set(flat0) <= set(range(23))
    again = list(MegatronPretrainingRandomSampler(23, 0, 2, 0, 2, seed=5))
    assert again == epoch0
    other_seed = list(MegatronPretrainingRandomSampler(23, 0, 2, 0, 2, seed=6))
    assert other_seed != epoch0
    # DP=2 x mbs=2 sees, step by step, what DP=1 x mbs=4 sees.
    one = merged_global_batches(lambda r, dp: MegatronPretrainingRandomSampler(23, 0, 4, r, dp, seed=5), 1)
    two = merged_global_batches(lambda r, dp: MegatronPretrainingRandomSampler(23, 0, 2, r, dp, seed=5), 2)
    assert one == two and len(set(sum(one, []))) == 20


def test_random_sampler_resume_across_epochs():
    def stream(consumed, rank):
        return list(itertools.islice(cyclic_iter(MegatronPretrainingRandomSampler(19, consumed, 3, rank, 2)), 40))

    for rank in (0, 1):
        full = stream(0, rank)
        for done in (1, 2, 3, 4, 7):  # 3 steps per epoch (18 of 19 samples)
            assert stream(done * 6, rank)[: 40 - done] == full[done:]


def test_loader_batches_and_resume():
    dataset = Tagged(30)
    loader = build_pretraining_data_loader(dataset, 0, 4, 1, 2)
    batches = [b["text"] for b in loader]
    assert len(batches) == 3
    assert all(b.dtype == torch.int64 and b.shape == (4, 5) for b in batches)
    assert batches[0][:, 0].tolist() == [4, 5, 6, 7]
    resumed = [b["text"] for b in build_pretraining_data_loader(dataset, 8, 4, 1, 2)]
    assert all(torch.equal(a, b) for a, b in zip(resumed, batches[1:])) and len(resumed) == 2
    assert build_pretraining_data_loader(None, 0, 4, 0, 1) is None
    with pytest.raises(ValueError, match="dataloader-type"):
        build_pretraining_data_loader(dataset, 0, 4, 0, 1, dataloader_type="random")


def test_cyclic_loader_resume_with_workers():
    dataset = Tagged(22)

    def run(consumed, workers, steps):
        loader = build_pretraining_data_loader(dataset, consumed, 2, 0, 2, "cyclic", num_workers=workers, seed=9)
        return [b["text"][:, 0].tolist() for b in itertools.islice(cyclic_iter(loader), steps)]

    full = run(0, 0, 14)  # 5 steps per epoch: crosses two epoch boundaries
    assert run(7 * 4, 0, 7) == full[7:]
    assert run(0, 2, 14) == full
