"""GPTDataset: split parsing, index arrays (against a transcription of Megatron's
algorithm), sample contents, the .npy cache, the C++/numpy sample-index helpers."""
import os
import warnings

import numpy as np
import pytest
import torch

from megatron.config import data_paths
from megatron.data import gpt_dataset as gd
from megatron.data import helpers
from tests.data_setup import reference_file


# ----------------------------------------------------------------------------
# Fakes and references
# ----------------------------------------------------------------------------

class FakeIndexed:
    """Duck type of MMapIndexedDataset; token value = 1000 * sequence + position."""

    def __init__(self, sizes):
        self.sizes = np.asarray(sizes, dtype=np.int32)
        self.doc_idx = np.arange(len(self.sizes) + 1, dtype=np.int64)
        self._seqs = [1000 * i + np.arange(n, dtype=np.int32) for i, n in enumerate(self.sizes)]

    def __len__(self):
        return len(self.sizes)

    def __getitem__(self, i):
        return self._seqs[i]

    def get(self, idx, offset=0, length=None):
        seq = self._seqs[idx]
        end = len(seq) if length is None else offset + length
        assert 0 <= offset <= end <= len(seq)
        return seq[offset:end]


def reference_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """Megatron's sample-index walk, written out step by step."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    out = [(0, 0)]
    pos, offset = 0, 0
    while len(out) <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            length = int(sizes[doc_idx[pos]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                pos, offset = pos + 1, 0
        out.append((pos, offset))
    return np.array(out, dtype=np.int32)


def reference_indices(documents, sizes, num_samples, seq_length, seed):
    """Megatron's doc/sample/shuffle index construction, written out independently."""
    tokens_per_epoch = int(np.sum(sizes[documents]))
    num_epochs, total = 0, 0
    while True:
        num_epochs += 1
        total += tokens_per_epoch
        if (total - 1) // seq_length >= num_samples:
            break
    separate = False
    if num_epochs > 1:
        before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = (num_samples - before_last) < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed=seed)

    def shuffled_docs(epochs):
        d = np.mgrid[0:epochs, 0:len(documents)][1]
        d[:] = documents
        d = d.reshape(-1).astype(np.int32)
        rng.shuffle(d)
        return d

    if separate:
        doc_idx = np.concatenate((shuffled_docs(num_epochs - 1), shuffled_docs(1)))
    else:
        doc_idx = shuffled_docs(num_epochs)
    sample_idx = reference_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    n_total = sample_idx.shape[0] - 1
    n_first = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length if separate else n_total
    first = np.arange(n_first, dtype=np.uint32)
    rng.shuffle(first)
    if n_first < n_total:
        last = np.arange(n_first, n_total, dtype=np.uint32)
        rng.shuffle(last)
        first = np.concatenate((first, last))
    return doc_idx, sample_idx, first, separate


def token_stream(indexed, doc_idx):
    return np.concatenate([indexed.get(int(d)) for d in doc_idx]).astype(np.int64)


def check_samples(dataset, indexed):
    """Sample k (before shuffling) is tokens k*seq .. (k+1)*seq of the document stream."""
    stream = token_stream(indexed, dataset.doc_idx)
    seq = dataset.seq_length
    for idx in range(len(dataset)):
        text = dataset[idx]["text"]
        k = int(dataset.shuffle_idx[idx])
        assert text.dtype == np.int64 and text.shape == (seq + 1,)
        np.testing.assert_array_equal(text, stream[k * seq:(k + 1) * seq + 1])


@pytest.fixture
def fake():
    rng = np.random.RandomState(7)
    return FakeIndexed(rng.randint(1, 40, size=30))


# ----------------------------------------------------------------------------
# Flags
# ----------------------------------------------------------------------------

def test_split_parsing():
    assert data_paths.parse_split_weights("969,30,1") == data_paths.parse_split_weights("969/30/1")
    assert data_paths.parse_split_weights("100") == [1.0, 0.0, 0.0]
    assert data_paths.parse_split_weights("8,2") == [0.8, 0.2, 0.0]
    assert gd.get_train_valid_test_split_("969,30,1", 1000) == [0, 969, 999, 1000]
    # round(10/3) = 3 each -> 9 in total; the shortfall moves every boundary up by one.
    assert gd.get_train_valid_test_split_("1,1,1", 10) == [0, 4, 7, 10]
    assert gd.get_train_valid_test_split_("1,0,0", 7) == [0, 7, 7, 7]
    for bad in ("a,b", "1,2,3,4", "0,0,0", "-1,2"):
        with pytest.raises(ValueError, match="--split"):
            data_paths.parse_split_weights(bad)


def test_data_prefix_parsing():
    assert data_paths.parse_data_prefix(["x"]) == (["x"], [1.0])
    assert data_paths.parse_data_prefix(["3", "a", "1", "b"]) == (["a", "b"], [0.75, 0.25])
    with pytest.raises(ValueError, match="weight/prefix pairs"):
        data_paths.parse_data_prefix(["1", "a", "b"])
    with pytest.raises(ValueError, match="not a number"):
        data_paths.parse_data_prefix(["a", "b"])
    assert gd.blended_num_samples([0.75, 0.25], (1000, 10, 0)) == [[754, 8, 0], [252, 3, 0]]


# ----------------------------------------------------------------------------
# Index arrays
# ----------------------------------------------------------------------------

def test_num_epochs_is_smallest_sufficient():
    rng = np.random.RandomState(0)
    for _ in range(300):
        tokens, seq, n = rng.randint(2, 500), rng.randint(1, 50), rng.randint(0, 2000)
        epochs = gd.num_epochs_for(tokens, seq, n)
        assert (epochs * tokens - 1) // seq >= n
        assert epochs == 1 or ((epochs - 1) * tokens - 1) // seq < n


# 411 tokens per epoch -> 25 samples of 16 in one epoch, 51 in two, 77 in three; the last
# epoch is kept apart when it gives fewer than int(0.8 * 25) = 20 samples.
@pytest.mark.parametrize("num_samples,expect_separate",
                         [(10, False), (30, True), (45, False), (60, True), (72, False)])
def test_index_arrays_match_megatron(fake, num_samples, expect_separate):
    documents = np.arange(3, 27, dtype=np.int32)
    seq = 16
    doc_idx, sample_idx, shuffle_idx = gd.build_index_arrays(documents, fake.sizes, num_samples, seq, 1234)
    ref_doc, ref_sample, ref_shuffle, separate = reference_indices(documents, fake.sizes, num_samples, seq, 1234)
    assert separate == expect_separate
    assert doc_idx.dtype == np.int32 and sample_idx.dtype == np.int32 and shuffle_idx.dtype == np.uint32
    np.testing.assert_array_equal(doc_idx, ref_doc)
    np.testing.assert_array_equal(sample_idx, ref_sample)
    np.testing.assert_array_equal(shuffle_idx, ref_shuffle)


def _random_case(rng):
    n = rng.randint(1, 30)
    sizes = rng.randint(0, 12, size=n).astype(np.int32)  # includes empty documents
    sizes[rng.randint(n)] += 2
    epochs = rng.randint(1, 4)
    doc_idx = np.concatenate([rng.permutation(n) for _ in range(epochs)]).astype(np.int32)
    return sizes, doc_idx, rng.randint(1, 20), epochs, int(sizes.sum())


def test_sample_idx_cpp_numpy_and_reference_agree():
    assert helpers.load_cpp_helpers() is not None, "C++ helpers failed to build here"
    rng = np.random.RandomState(1)
    for _ in range(300):
        sizes, doc_idx, seq, epochs, tokens = _random_case(rng)
        ref = reference_sample_idx(sizes, doc_idx, seq, epochs, tokens)
        cpp = helpers.build_sample_idx(sizes, doc_idx, seq, epochs, tokens)
        fallback = helpers.build_sample_idx_numpy(sizes, doc_idx, seq, epochs, tokens)
        for got in (cpp, fallback):
            assert got.dtype == np.int32
            np.testing.assert_array_equal(got, ref)


def test_sample_idx_errors():
    sizes = np.array([5, 5], dtype=np.int32)
    for build in (helpers.build_sample_idx, helpers.build_sample_idx_numpy):
        with pytest.raises(ValueError, match="fewer tokens"):
            build(sizes, np.array([0], dtype=np.int32), 3, 2, 5)
        with pytest.raises(ValueError, match="outside"):
            build(sizes, np.array([0, 7], dtype=np.int32), 3, 1, 10)
        with pytest.raises(ValueError, match="seq_length"):
            build(sizes, np.array([0, 1], dtype=np.int32), 0, 1, 10)


@pytest.fixture
def fresh_helpers(monkeypatch, tmp_path):
    """Helpers that build again, into an empty directory; restored afterwards."""
    monkeypatch.setenv("MEGATRON_HELPERS_BUILD_DIR", str(tmp_path / "build"))
    helpers._reset_for_tests()
    yield
    helpers._reset_for_tests()


def test_build_failure_warns_once_and_falls_back(fresh_helpers, monkeypatch):
    monkeypatch.setenv("CXX", "/bin/false")
    sizes, doc_idx, seq, epochs, tokens = _random_case(np.random.RandomState(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = helpers.build_sample_idx(sizes, doc_idx, seq, epochs, tokens)
        second = helpers.build_sample_idx(sizes, doc_idx, seq, epochs, tokens)
    assert len([w for w in caught if "numpy fallback" in str(w.message)]) == 1
    np.testing.assert_array_equal(first, reference_sample_idx(sizes, doc_idx, seq, epochs, tokens))
    np.testing.assert_array_equal(first, second)


def test_env_var_forces_fallback(fresh_helpers, monkeypatch):
    monkeypatch.setenv("MEGATRON_NO_CPP_HELPERS", "1")
    monkeypatch.setenv("CXX", "/bin/false")  # would warn if a build were attempted
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert helpers.load_cpp_helpers() is None
        sizes, doc_idx, seq, epochs, tokens = _random_case(np.random.RandomState(4))
        helpers.build_sample_idx(sizes, doc_idx, seq, epochs, tokens)
    assert not (os.path.exists(os.environ["MEGATRON_HELPERS_BUILD_DIR"]))


# ----------------------------------------------------------------------------
# The dataset and its cache
# ----------------------------------------------------------------------------

def test_samples_follow_the_token_stream(fake, tmp_path):
    prefix = str(tmp_path / "fake")
    for num_samples, seq in ((5, 7), (70, 16), (45, 16)):
        ds = gd.GPTDataset("train", prefix, np.arange(3, 27), fake, num_samples, seq, 99)
        assert len(ds) >= num_samples
        check_samples(ds, fake)
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_cache_files_reuse_and_staleness(fake, tmp_path, monkeypatch):
    prefix = str(tmp_path / "fake")
    first = gd.GPTDataset("train", prefix, np.arange(0, 20), fake, 50, 8, 5)
    names = sorted(os.listdir(tmp_path))
    base = "fake_train_indexmap_50ns_8sl_5s"
    assert names == sorted([f"{base}_{k}.npy" for k in ("doc_idx", "sample_idx", "shuffle_idx")] + [f"{base}_desc.json"])

    def must_not_build(*args, **kwargs):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(gd, "build_index_arrays", must_not_build)
    again = gd.GPTDataset("train", prefix, np.arange(0, 20), fake, 50, 8, 5)
    np.testing.assert_array_equal(again.sample_idx, first.sample_idx)
    monkeypatch.undo()
    # Another split with the same name and sizes: the cache is stale and rebuilt.
    other = gd.GPTDataset("train", prefix, np.arange(5, 25), fake, 50, 8, 5)
    ref_doc, _, _, _ = reference_indices(np.arange(5, 25), fake.sizes, 50, 8, 5)
    np.testing.assert_array_equal(other.doc_idx, ref_doc)
    assert sorted(os.listdir(tmp_path)) == names  # no temporary files left behind


def test_pickles_by_file_name(fake, tmp_path):
    import pickle

    ds = gd.GPTDataset("train", str(tmp_path / "fake"), np.arange(30), fake, 5000, 8, 2)
    payload = pickle.dumps(ds)
    assert len(payload) < ds.sample_idx.nbytes / 2  # the index arrays are not inside
    clone = pickle.loads(payload)
    assert len(clone) == len(ds)
    for i in range(0, len(ds), 97):
        np.testing.assert_array_equal(clone[i]["text"], ds[i]["text"])


def test_read_only_data_dir_needs_cache_path(fake, tmp_path):
    data_dir, cache_dir = tmp_path / "ro", tmp_path / "cache"
    data_dir.mkdir()
    data_dir.chmod(0o555)
    try:
        with pytest.raises(PermissionError, match="--data-cache-path"):
            gd.GPTDataset("train", str(data_dir / "fake"), np.arange(10), fake, 5, 8, 1)
        ds = gd.GPTDataset("train", str(data_dir / "fake"), np.arange(10), fake, 5, 8, 1, str(cache_dir))
        assert os.listdir(data_dir) == []
        assert any(name.startswith("fake_train_indexmap_5ns_8sl_1s") for name in os.listdir(cache_dir))
        check_samples(ds, fake)
    finally:
        data_dir.chmod(0o755)


def test_bad_arguments(fake, tmp_path):
    prefix = str(tmp_path / "fake")
    with pytest.raises(ValueError, match="document ids"):
        gd.GPTDataset("train", prefix, np.arange(25, 40), fake, 5, 8, 1)
    with pytest.raises(ValueError, match="seq-length"):
        gd.GPTDataset("train", prefix, np.arange(5), fake, 5, 0, 1)
    with pytest.raises(ValueError, match="too few"):
        gd.GPTDataset("train", prefix, np.arange(1), FakeIndexed([1]), 5, 8, 1)


def test_distributed_rank0_builds(fake, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        ds = gd.GPTDataset("valid", str(tmp_path / "fake"), np.arange(30), fake, 20, 8, 3)
        check_samples(ds, fake)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------
# With the real indexed dataset
# ----------------------------------------------------------------------------

def write_indexed(prefix, docs):
    indexed = pytest.importorskip("megatron.data.indexed_dataset")
    builder = indexed.MMapIndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for doc in docs:
        builder.add_item(np.asarray(doc))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return indexed.MMapIndexedDataset(prefix)


def test_fast_path_equals_get_path(tmp_path):
    rng = np.random.RandomState(2)
    docs = [rng.randint(0, 60000, size=rng.randint(1, 50)) for _ in range(40)]
    prefix = str(tmp_path / "corpus_text_document")
    indexed = write_indexed(prefix, docs)
    fast = gd.GPTDataset("train", prefix, np.arange(40), indexed, 60, 20, 8)
    slow = gd.GPTDataset("train", str(tmp_path / "elsewhere"), np.arange(40), indexed, 60, 20, 8)
    assert fast._tokens is not None and slow._tokens is None
    for i in range(len(fast)):
        np.testing.assert_array_equal(fast[i]["text"], slow[i]["text"])
    check_samples(fast, indexed)


def test_build_datasets_single_prefix(tmp_path):
    rng = np.random.RandomState(3)
    prefix = str(tmp_path / "corpus_text_document")
    indexed = write_indexed(prefix, [rng.randint(0, 100, size=rng.randint(5, 30)) for _ in range(50)])
    train, valid, test = gd.build_train_valid_test_datasets([prefix], "8,2", (40, 10, 5), 16, 1234)
    assert test is None
    assert len(train) >= 40 and len(valid) >= 10
    check_samples(train, indexed)
    assert set(train.doc_idx.tolist()) == set(range(40)) and set(valid.doc_idx.tolist()) == set(range(40, 50))
    with pytest.raises(FileNotFoundError, match="not found"):
        gd.build_train_valid_test_datasets([str(tmp_path / "missing")], "1", (1, 0, 0), 16, 1)


def test_megatron_compat_dataset(tmp_path):
    idx = reference_file("megatron-compat", "meg-gpt2-openwebtext_text_document.idx")
    pytest.importorskip("megatron.data.indexed_dataset")
    prefix = str(idx)[:-len(".idx")]
    before = sorted(os.listdir(os.path.dirname(prefix)))
    train, valid, test = gd.build_train_valid_test_datasets(
        [prefix], "969,30,1", (300, 30, 3), 512, 1234, data_cache_path=str(tmp_path))
    assert sorted(os.listdir(os.path.dirname(prefix))) == before
    assert len(os.listdir(tmp_path)) == 12  # 3 splits x (3 arrays + description)
    assert set(train.doc_idx.tolist()) == set(range(969))
    assert set(test.doc_idx.tolist()) == {999}
    assert all(ds._tokens is not None for ds in (train, valid, test))  # the fast read path
    check_samples(valid, valid.indexed_dataset)
    check_samples(test, test.indexed_dataset)
    stream = token_stream(train.indexed_dataset, train.doc_idx)
    for idx in range(0, len(train), 7):
        k = int(train.shuffle_idx[idx])
        np.testing.assert_array_equal(train[idx]["text"], stream[k * 512:(k + 1) * 512 + 1])
    assert int(stream.max()) == 4999 and (stream == 4999).sum() >= 969  # every document ends with eod
    batch = torch.utils.data.default_collate([train[0], train[1]])
    assert batch["text"].dtype == torch.int64 and batch["text"].shape == (2, 513)
