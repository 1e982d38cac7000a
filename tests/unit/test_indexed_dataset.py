"""MMIDIDX reader/writer: exact byte layout, Megatron compatibility, errors."""
import struct

import numpy as np
import pytest

from megatron.data.indexed_dataset import (best_fitting_dtype, data_file_path, DTYPES,
                                           index_file_path, make_builder, make_dataset,
                                           MMapIndexedDataset, MMapIndexedDatasetBuilder)
from tests.data_setup import reference_file

COMPAT = ("megatron-compat", "meg-gpt2-openwebtext_text_document")


def build(prefix, docs, dtype=np.uint16):
    """Write ``docs`` (each a list of sequences) and return the opened dataset."""
    builder = MMapIndexedDatasetBuilder(data_file_path(prefix), dtype)
    for doc in docs:
        for seq in doc:
            builder.add_item(seq)
        builder.end_document()
    builder.finalize(index_file_path(prefix))
    return MMapIndexedDataset(prefix)


def test_exact_index_layout(tmp_path):
    prefix = str(tmp_path / "d")
    build(prefix, [[[1, 2, 3]], [[4], [5, 6]]], np.int32)
    raw = open(index_file_path(prefix), "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack_from("<QBQQ", raw, 9) == (1, 4, 3, 3)
    body = raw[34:]
    assert np.frombuffer(body, np.int32, 3).tolist() == [3, 1, 2]
    assert np.frombuffer(body, np.int64, 3, 12).tolist() == [0, 12, 16]
    assert np.frombuffer(body, np.int64, 3, 36).tolist() == [0, 1, 3]
    assert len(raw) == 34 + 12 * 3 + 8 * 3
    data = open(data_file_path(prefix), "rb").read()
    assert np.frombuffer(data, np.int32).tolist() == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("code", sorted(DTYPES))
def test_roundtrip_every_dtype(tmp_path, code):
    dtype = DTYPES[code]
    prefix = str(tmp_path / "d")
    docs = [[np.arange(5, dtype=dtype)], [np.array([7], dtype=dtype), np.arange(3, dtype=dtype)]]
    ds = build(prefix, docs, dtype)
    assert open(index_file_path(prefix), "rb").read()[17] == code
    assert ds.dtype == dtype and len(ds) == 3
    assert ds.sizes.tolist() == [5, 1, 3] and ds.sizes.dtype == np.int32
    assert ds.doc_idx.tolist() == [0, 1, 3] and ds.doc_idx.dtype == np.int64
    assert ds.pointers.tolist() == [0, 5 * ds[0].itemsize, 6 * ds[0].itemsize]
    assert ds[1].tolist() == [7] and ds[-1].tolist() == [0, 1, 2]


def test_items_are_views_and_get_slices(tmp_path):
    ds = build(str(tmp_path / "d"), [[list(range(10))], [[42, 43]]])
    item = ds[0]
    assert not item.flags.owndata and not item.flags.writeable
    assert ds.get(0, offset=3, length=4).tolist() == [3, 4, 5, 6]
    assert ds.get(0, offset=8).tolist() == [8, 9]
    assert [a.tolist() for a in ds[0:2]] == [list(range(10)), [42, 43]]
    with pytest.raises(IndexError, match="out of range"):
        ds[2]
    with pytest.raises(IndexError, match="outside sequence 1"):
        ds.get(1, offset=1, length=2)


def test_builder_inputs_and_checks(tmp_path):
    torch = pytest.importorskip("torch")
    prefix = str(tmp_path / "d")
    builder = make_builder(data_file_path(prefix), vocab_size=1000)
    assert builder.dtype == np.uint16
    builder.add_item(torch.tensor([1, 2, 3]))
    builder.add_item([4, 5])
    builder.end_document()
    builder.add_doc(np.array([6, 7, 8]), [1, 2])
    with pytest.raises(ValueError, match="70000 does not fit dtype uint16"):
        builder.add_item([1, 70000])
    with pytest.raises(ValueError, match="disagree"):
        builder.add_doc([1, 2], [3])
    builder.finalize(index_file_path(prefix))
    ds = make_dataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3], [4, 5], [6], [7, 8]]
    assert ds.doc_idx.tolist() == [0, 2, 4]


def test_best_fitting_dtype():
    assert best_fitting_dtype(50257) == np.uint16
    assert best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32
    assert best_fitting_dtype(None) == np.int32


def test_builder_writes_nothing_under_final_names_until_finalize(tmp_path):
    prefix = str(tmp_path / "d")
    builder = MMapIndexedDatasetBuilder(data_file_path(prefix), np.int32)
    builder.add_item([1, 2])
    builder.end_document()
    assert not MMapIndexedDataset.exists(prefix)
    builder.abort()
    assert list(tmp_path.iterdir()) == []


def test_empty_dataset(tmp_path):
    ds = build(str(tmp_path / "d"), [])
    assert len(ds) == 0 and ds.doc_idx.tolist() == [0]


def test_merge_offsets_doc_index(tmp_path):
    a = build(str(tmp_path / "a"), [[[1, 2]], [[3], [4, 5]]])
    b = build(str(tmp_path / "b"), [[[6], [7]], [[8, 9, 10]]])
    builder = MMapIndexedDatasetBuilder(data_file_path(str(tmp_path / "c")), np.uint16)
    builder.merge_file_(str(tmp_path / "a"))
    builder.merge_file_(str(tmp_path / "b"))
    builder.finalize(index_file_path(str(tmp_path / "c")))
    c = MMapIndexedDataset(str(tmp_path / "c"))
    assert c.doc_idx.tolist() == [0, 1, 3, 5, 6]
    assert [c[i].tolist() for i in range(len(c))] == [
        x.tolist() for x in list(a[0:len(a)]) + list(b[0:len(b)])]
    build(str(tmp_path / "wide"), [[[1]]], np.int32)
    with pytest.raises(ValueError, match="dtype is int32.*uint16"):
        MMapIndexedDatasetBuilder(str(tmp_path / "x.bin"), np.uint16).merge_file_(
            str(tmp_path / "wide"))


def corrupt(tmp_path, offset, data):
    prefix = str(tmp_path / "d")
    build(prefix, [[[1, 2, 3]], [[4, 5]]])
    path = index_file_path(prefix)
    raw = bytearray(open(path, "rb").read())
    raw[offset:offset + len(data)] = data
    open(path, "wb").write(bytes(raw))
    return prefix, path


@pytest.mark.parametrize("offset,data,message", [
    (0, b"NOTMMIDX\x00", "not an MMIDIDX index"),
    (9, struct.pack("<Q", 2), "unknown MMIDIDX version 2"),
    (17, bytes([9]), "unknown dtype code 9"),
])
def test_bad_index_headers(tmp_path, offset, data, message):
    prefix, path = corrupt(tmp_path, offset, data)
    with pytest.raises(ValueError, match=message) as info:
        MMapIndexedDataset(prefix)
    assert path in str(info.value)


def test_truncated_files(tmp_path):
    prefix = str(tmp_path / "d")
    build(prefix, [[[1, 2, 3]], [[4, 5]]])
    idx, bin_ = index_file_path(prefix), data_file_path(prefix)
    full_idx, full_bin = open(idx, "rb").read(), open(bin_, "rb").read()
    for cut in (20, len(full_idx) - 1):
        open(idx, "wb").write(full_idx[:cut])
        with pytest.raises(ValueError, match=f"{idx}: truncated index"):
            MMapIndexedDataset(prefix)
    open(idx, "wb").write(full_idx)
    open(bin_, "wb").write(full_bin[:-1])
    with pytest.raises(ValueError, match=f"{bin_}: data file is 9 bytes.*refers to 10"):
        MMapIndexedDataset(prefix)
    with pytest.raises(FileNotFoundError, match="nothing.idx"):
        MMapIndexedDataset(str(tmp_path / "nothing"))


def test_megatron_file_reads_and_rewrites_byte_for_byte(tmp_path):
    idx = reference_file(*COMPAT[:-1], COMPAT[-1] + ".idx")
    prefix = str(idx)[:-4]
    ds = MMapIndexedDataset(prefix)
    assert ds.dtype == np.uint16 and len(ds) == 1000 and len(ds.doc_idx) == 1001
    assert int(ds.sizes.sum()) == 1361845
    assert all(ds[i][-1] == 4999 for i in range(len(ds)))
    out = str(tmp_path / "copy")
    builder = make_builder(data_file_path(out), vocab_size=5000)
    for i in range(len(ds)):
        builder.add_item(ds[i])
        builder.end_document()
    builder.finalize(index_file_path(out))
    for path, copy in ((index_file_path(prefix), index_file_path(out)),
                       (data_file_path(prefix), data_file_path(out))):
        assert open(path, "rb").read() == open(copy, "rb").read(), path
