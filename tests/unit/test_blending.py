"""Blending indices (C++ and Python twins) and BlendedDataset."""
import numpy as np
import pytest

from megatron.data import helpers
from megatron.data.blended_dataset import BlendedDataset


def blend(weights, size, build=helpers.build_blending_indices):
    index = np.zeros(size, dtype=np.uint8)
    sample = np.zeros(size, dtype=np.int64)
    build(index, sample, np.asarray(weights, dtype=np.float64), len(weights), size)
    return index, sample


def test_hand_computed_example():
    # error_d = w_d * max(i, 1) - count_d; i=4 is a tie (0 vs 0) that goes to dataset 0.
    for build in (helpers.build_blending_indices, helpers.build_blending_indices_numpy):
        index, sample = blend([0.75, 0.25], 8, build)
        assert index.tolist() == [0, 1, 0, 0, 0, 1, 0, 0]
        assert sample.tolist() == [0, 0, 1, 2, 3, 1, 4, 5]
        index, _ = blend([0.5, 0.5], 6, build)
        assert index.tolist() == [0, 1, 0, 1, 0, 1]


def test_cpp_and_python_agree():
    assert helpers.load_cpp_helpers() is not None, "C++ helpers failed to build here"
    rng = np.random.RandomState(0)
    cases = [[1 / 3, 1 / 3, 1 / 3], [0.1, 0.2, 0.7], [1.0], [0.5, 0.0, 0.5]]
    cases += [list(rng.dirichlet(np.ones(k))) for k in rng.randint(1, 9, size=30)]
    for weights in cases:
        size = int(rng.randint(0, 3000))
        cpp = blend(weights, size)
        fallback = blend(weights, size, helpers.build_blending_indices_numpy)
        np.testing.assert_array_equal(cpp[0], fallback[0])
        np.testing.assert_array_equal(cpp[1], fallback[1])


def test_blend_follows_weights():
    weights = [0.6, 0.3, 0.1]
    index, sample = blend(weights, 5000)
    counts = np.zeros(3)
    for i, d in enumerate(index):
        assert sample[i] == counts[d]  # each dataset's samples are taken in order
        counts[d] += 1
        assert np.all(np.abs(counts - np.array(weights) * (i + 1)) <= 1.0 + 1e-9)


def test_argument_checks():
    with pytest.raises(ValueError, match="uint8"):
        helpers.build_blending_indices(np.zeros(3, np.int64), np.zeros(3, np.int64), [1.0], 1, 3)
    with pytest.raises(ValueError, match="weights for"):
        helpers.build_blending_indices(np.zeros(3, np.uint8), np.zeros(3, np.int64), [1.0], 2, 3)
    with pytest.raises(ValueError, match="size=5"):
        helpers.build_blending_indices(np.zeros(3, np.uint8), np.zeros(3, np.int64), [1.0], 1, 5)


class Numbered:
    """Dataset whose sample i is {"text": [offset + i]}."""

    def __init__(self, offset, length):
        self.offset, self.length = offset, length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        assert 0 <= i < self.length
        return {"text": np.array([self.offset + i])}


def test_blended_dataset():
    datasets = [Numbered(0, 80), Numbered(1000, 40)]
    blended = BlendedDataset(datasets, [3, 1], 100)  # weights are normalised
    assert len(blended) == 100
    values = [int(blended[i]["text"][0]) for i in range(100)]
    assert sum(v >= 1000 for v in values) == 25
    assert [v for v in values if v < 1000] == list(range(75))
    with pytest.raises(IndexError):
        blended[100]


def test_blended_dataset_errors():
    with pytest.raises(ValueError, match="only 10"):
        BlendedDataset([Numbered(0, 10), Numbered(0, 100)], [0.5, 0.5], 40)
    with pytest.raises(ValueError, match="2 weights for 1"):
        BlendedDataset([Numbered(0, 10)], [0.5, 0.5], 4)
    with pytest.raises(ValueError, match="non-negative"):
        BlendedDataset([Numbered(0, 10), Numbered(0, 10)], [-1, 2], 4)


def test_build_blended_datasets(tmp_path):
    indexed = pytest.importorskip("megatron.data.indexed_dataset")
    from megatron.data import gpt_dataset as gd

    rng = np.random.RandomState(0)
    prefixes = []
    for k, low in enumerate((0, 30000)):  # token ranges tell the two corpora apart
        prefix = str(tmp_path / f"corpus{k}_text_document")
        builder = indexed.MMapIndexedDatasetBuilder(prefix + ".bin", np.uint16)
        for _ in range(40):
            builder.add_item(rng.randint(low, low + 1000, size=rng.randint(5, 40)))
            builder.end_document()
        builder.finalize(prefix + ".idx")
        prefixes.append(prefix)
    train, valid, test = gd.build_train_valid_test_datasets(
        ["0.7", prefixes[0], "0.3", prefixes[1]], "9,1,0", (200, 20, 0), 8, 1234)
    assert isinstance(train, BlendedDataset) and test is None
    assert len(train) == 200 and len(valid) == 20
    # Each GPTDataset was asked for ceil(n * w * 1.005) samples.
    assert [len(d) >= n for d, n in zip(train.datasets, (141, 61))] == [True, True]
    from_second = [int(train[i]["text"][0] >= 30000) for i in range(200)]
    assert sum(from_second) == 60
    assert all((train[i]["text"] >= 30000).all() == bool(from_second[i]) for i in range(200))
