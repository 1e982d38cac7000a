"""Megatron's memory-mapped indexed dataset (MMIDIDX version 1), both ways.

A dataset is two files sharing a prefix:

``prefix.bin``  the token arrays of every sequence, back to back, no header.
``prefix.idx``  little-endian: the 9-byte magic ``MMIDIDX\\0\\0``, ``<Q`` version (1),
                ``<B`` dtype code, ``<Q`` number of sequences N, ``<Q`` doc-index length M,
                then int32 sizes[N] (tokens per sequence), int64 pointers[N] (byte
                offset of each sequence in ``.bin``), int64 doc_idx[M].

``doc_idx`` starts with 0 and holds, after each document, the number of sequences
written so far: document d is sequences ``doc_idx[d]:doc_idx[d+1]``. Without
sentence splitting every document is one sequence.

Our builder also writes ``prefix.bin.sha256`` (the sha256 of the ``.bin`` and the ``.idx``
in ``sha256sum`` format; Megatron-LM ignores it, and the ``.idx`` stays byte-compatible):
when present, both files are checked against it at open (once per process and file
version: a full read of the ``.bin``), so flipped bits, a swapped dtype code and a
``.bin`` of another dataset are refused.
Without it, a ``.bin`` longer or shorter than its index describes is refused.
"""
import hashlib
import os
import struct
from typing import List, Optional, Sequence, Union

import numpy as np

from megatron.files import (file_sha256, publish, remove_quietly, temp_name, write_temp,
                            write_text_durably)

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N, M

DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
          6: np.float64, 7: np.float32, 8: np.uint16}


def dtype_code(dtype) -> int:
    """The MMIDIDX code of a numpy dtype."""
    dtype = np.dtype(dtype)
    for code, candidate in DTYPES.items():
        if np.dtype(candidate) == dtype:
            return code
    raise ValueError(f"dtype {dtype} cannot be stored in an MMIDIDX file; "
                     f"use one of {[np.dtype(d).name for d in DTYPES.values()]}")


def best_fitting_dtype(vocab_size: Optional[int] = None):
    """uint16 when every id fits comfortably (vocab < 65500), else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def index_file_path(prefix: str) -> str:
    return f"{prefix}.idx"


def data_file_path(prefix: str) -> str:
    return f"{prefix}.bin"


class IndexedDatasetError(ValueError):
    """A ``.idx``/``.bin`` pair that is not a consistent MMIDIDX dataset; the
    message names the file and the offending entry, on one line."""


DIGEST_SUFFIX = ".sha256"
_CHUNK = 1 << 22  # entries checked at a time, so huge indexes need no big temporaries


class _Index:
    """The parsed, memory-mapped ``.idx`` file, checked for consistency entry by entry."""

    def __init__(self, path: str):
        self.path = path
        self._mmap = np.memmap(path, mode="r", order="C") if os.path.getsize(path) else b""
        buffer = memoryview(self._mmap)
        count, doc_count = self._read_header(buffer)
        offset = _HEADER.size
        self.sizes = np.frombuffer(buffer, np.int32, count, offset)
        self.pointers = np.frombuffer(buffer, np.int64, count, offset + 4 * count)
        self.doc_idx = np.frombuffer(buffer, np.int64, doc_count, offset + 12 * count)
        self._check_sizes_and_pointers()
        self._check_doc_idx()

    def _fail(self, message: str):
        raise IndexedDatasetError(f"{self.path}: {message}; regenerate the dataset "
                                  "(tools/preprocess_data.py)")

    def _read_header(self, buffer):
        if len(buffer) < _HEADER.size:
            self._fail(f"truncated index ({len(buffer)} bytes, the header alone is {_HEADER.size})")
        magic, version, code, count, doc_count = _HEADER.unpack_from(buffer, 0)
        if magic != MAGIC:
            self._fail(f"not an MMIDIDX index (magic {magic!r}, expected {MAGIC!r}); only "
                       "Megatron's mmap format is supported")
        if version != VERSION:
            self._fail(f"unknown MMIDIDX version {version} (only {VERSION} is supported)")
        if code not in DTYPES:
            self._fail(f"unknown dtype code {code} (valid: {sorted(DTYPES)})")
        self.dtype = DTYPES[code]
        expected = _HEADER.size + 12 * count + 8 * doc_count
        if len(buffer) != expected:
            state = "truncated index" if len(buffer) < expected else "index with trailing bytes"
            self._fail(f"{state}: {len(buffer)} bytes, but its header's {count} sequences and "
                       f"{doc_count} doc-index entries need exactly {expected}")
        if doc_count < 1:
            self._fail("the doc index is empty (it starts with 0)")
        return count, doc_count

    def _check_sizes_and_pointers(self):
        """sizes >= 0, pointers[0] == 0 and pointers[i + 1] == pointers[i] + sizes[i] * itemsize."""
        itemsize = np.dtype(self.dtype).itemsize
        expected_next = 0
        for start in range(0, len(self.sizes), _CHUNK):
            sizes = self.sizes[start:start + _CHUNK].astype(np.int64)
            pointers = self.pointers[start:start + _CHUNK]
            bad = np.flatnonzero(sizes < 0)
            if bad.size:
                i = start + int(bad[0])
                self._fail(f"sequence {i} has a negative size {int(self.sizes[i])}")
            expected = expected_next + np.concatenate(([0], np.cumsum(sizes[:-1] * itemsize)))
            bad = np.flatnonzero(pointers != expected)
            if bad.size:
                i = start + int(bad[0])
                self._fail(f"sequence {i} points at byte {int(self.pointers[i])}, but the sizes "
                           f"before it put it at byte {int(expected[bad[0]])}")
            expected_next = int(expected[-1]) + int(sizes[-1]) * itemsize

    def _check_doc_idx(self):
        """doc_idx starts at 0, never decreases and stays within the sequence count."""
        count = len(self.sizes)
        if self.doc_idx[0] != 0:
            self._fail(f"doc index entry 0 is {int(self.doc_idx[0])}, expected 0")
        for start in range(0, len(self.doc_idx), _CHUNK):
            part = self.doc_idx[max(0, start - 1):start + _CHUNK]
            bad = np.flatnonzero((part[1:] < part[:-1]) | (part[1:] > count))
            if bad.size:
                i = max(0, start - 1) + int(bad[0]) + 1
                self._fail(f"doc index entry {i} is {int(self.doc_idx[i])}, outside "
                           f"[{int(self.doc_idx[i - 1])}, {count}] (entries never decrease and "
                           "stay within the sequence count)")

    def data_bytes(self) -> int:
        """Bytes of ``.bin`` the index refers to."""
        if len(self.sizes) == 0:
            return 0
        itemsize = np.dtype(self.dtype).itemsize
        return int(self.pointers[-1]) + int(self.sizes[-1]) * itemsize


class MMapIndexedDataset:
    """Read-only view of ``prefix.bin``/``prefix.idx``; items are zero-copy numpy views."""

    def __init__(self, path_prefix: str):
        self._prefix = path_prefix
        for path in (index_file_path(path_prefix), data_file_path(path_prefix)):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"dataset file not found: {path} (a dataset is named "
                                        "by its prefix, without .bin/.idx)")
        self._index = _Index(index_file_path(path_prefix))
        self._bin = self._map_data(data_file_path(path_prefix), self._index.data_bytes())
        check_data_digest(path_prefix)

    @staticmethod
    def _map_data(path: str, needed: int):
        size = os.path.getsize(path)
        if size != needed:
            state = "truncated" if size < needed else "longer than its index describes"
            raise IndexedDatasetError(f"{path}: data file is {size} bytes but its index refers to "
                                      f"{needed}, which it must match exactly; the .bin is {state} "
                                      f"or belongs to another .idx; regenerate the dataset")
        return memoryview(np.memmap(path, mode="r", order="C")) if size else b""

    def __len__(self) -> int:
        return len(self._index.sizes)

    def __getitem__(self, idx: Union[int, slice]):
        if isinstance(idx, slice):
            return [self[i] for i in range(*idx.indices(len(self)))]
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``offset:offset+length`` of sequence ``idx`` (to its end by default)."""
        count = len(self)
        if not -count <= idx < count:
            raise IndexError(f"sequence index {idx} out of range for {count} sequences")
        idx = int(idx) % count
        size = int(self._index.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"offset {offset} + length {length} outside sequence {idx} "
                             f"of {size} tokens")
        dtype = self._index.dtype
        start = int(self._index.pointers[idx]) + offset * np.dtype(dtype).itemsize
        return np.frombuffer(self._bin, dtype=dtype, count=length, offset=start)

    @property
    def sizes(self) -> np.ndarray:
        return self._index.sizes

    @property
    def pointers(self) -> np.ndarray:
        return self._index.pointers

    @property
    def doc_idx(self) -> np.ndarray:
        return self._index.doc_idx

    @property
    def dtype(self):
        return self._index.dtype

    @property
    def supports_prefetch(self) -> bool:
        return False

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return (os.path.exists(index_file_path(path_prefix))
                and os.path.exists(data_file_path(path_prefix)))


_VERIFIED: dict = {}  # (path, size, mtime) of both files -> True: each process hashes once


def _read_digests(sidecar: str) -> dict:
    """{".bin": hex, ".idx": hex} from a sha256sum-format sidecar."""
    digests = {}
    with open(sidecar, "rb") as f:
        for line in f.read(4096).decode("utf-8", "replace").splitlines():
            parts = line.split()
            if len(parts) == 2 and os.path.splitext(parts[1])[1] in (".bin", ".idx"):
                digests[os.path.splitext(parts[1])[1]] = parts[0].lstrip("*")
    return digests


def check_data_digest(path_prefix: str) -> None:
    """Compare ``prefix.bin`` (and ``prefix.idx``) with the ``prefix.bin.sha256`` sidecar
    when there is one."""
    paths = {".bin": data_file_path(path_prefix), ".idx": index_file_path(path_prefix)}
    sidecar = paths[".bin"] + DIGEST_SUFFIX
    if not os.path.isfile(sidecar):
        return
    key = tuple((os.path.abspath(p), os.stat(p).st_size, os.stat(p).st_mtime_ns)
                for p in paths.values())
    if key in _VERIFIED:
        return
    digests = _read_digests(sidecar)
    if ".bin" not in digests:
        raise IndexedDatasetError(f"{sidecar}: no sha256 line for the .bin; regenerate the "
                                  f"dataset or remove the sidecar")
    for ext, expected in digests.items():
        if file_sha256(paths[ext]) != expected:
            raise IndexedDatasetError(f"{paths[ext]}: does not match its digest in {sidecar}: it "
                                      f"is corrupt or belongs to another dataset; regenerate the "
                                      f"dataset (or remove the sidecar if another tool rewrote it)")
    _VERIFIED[key] = True


class MMapIndexedDatasetBuilder:
    """Writes an MMIDIDX dataset: items to ``.bin`` as they come, the index at the end.

    The data goes to a temporary file that ``finalize`` renames, so an
    interrupted build leaves nothing under the final names (``abort`` cleans up).
    """

    def __init__(self, bin_path: str, dtype=np.int64, buffer_bytes: int = 1 << 22):
        dtype_code(dtype)  # validates
        self._dtype = np.dtype(dtype)
        self._bin_path = os.fspath(bin_path)
        self._tmp_path = temp_name(self._bin_path)
        self._file = open(self._tmp_path, "wb", buffering=buffer_bytes)
        self._sha256 = hashlib.sha256()
        self._sizes: List[int] = []
        self._doc_idx: List[int] = [0]

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    def _as_array(self, tokens) -> np.ndarray:
        """Tokens as a flat array of the builder's dtype, rejecting ids that do not fit."""
        array = np.asarray(tokens)
        if array.dtype == object:
            raise ValueError("tokens must be numbers, got objects")
        if array.size and self._dtype.kind in "iu" and array.dtype != self._dtype:
            info = np.iinfo(self._dtype)
            low, high = array.min(), array.max()
            if low < info.min or high > info.max:
                raise ValueError(f"token id {low if low < info.min else high} does not fit "
                                 f"dtype {self._dtype.name}; build with a wider dtype "
                                 "(best_fitting_dtype(vocab_size))")
        return np.ascontiguousarray(array.reshape(-1), dtype=self._dtype)

    def add_item(self, tokens) -> None:
        """Append one sequence (numpy array, list or CPU tensor of ids)."""
        array = self._as_array(tokens)
        self._write(array.tobytes(order="C"))
        self._sizes.append(array.size)

    def _write(self, data: bytes) -> None:
        self._file.write(data)
        self._sha256.update(data)

    def end_document(self) -> None:
        """Close the current document: it spans the sequences added since the last one."""
        self._doc_idx.append(len(self._sizes))

    def add_doc(self, tokens, lengths: Sequence[int]) -> None:
        """Append one document made of sequences of ``lengths`` tokens (flat ``tokens``)."""
        self.add_docs(tokens, lengths, [len(lengths)])

    def add_docs(self, tokens, lengths: Sequence[int], seqs_per_doc: Sequence[int]) -> None:
        """Append many documents at once: flat ``tokens`` cut into sequences of
        ``lengths`` tokens, grouped into documents of ``seqs_per_doc`` sequences."""
        array = self._as_array(tokens)
        lengths = np.asarray(lengths, dtype=np.int64)
        seqs_per_doc = np.asarray(seqs_per_doc, dtype=np.int64)
        if int(lengths.sum()) != array.size or int(seqs_per_doc.sum()) != lengths.size:
            raise ValueError(f"add_docs: {array.size} tokens, lengths summing to "
                             f"{int(lengths.sum())} over {lengths.size} sequences, and "
                             f"seqs_per_doc summing to {int(seqs_per_doc.sum())} disagree")
        self._write(array.tobytes(order="C"))
        base = len(self._sizes)
        self._sizes.extend(lengths.tolist())
        self._doc_idx.extend((base + np.cumsum(seqs_per_doc)).tolist())

    def merge_file_(self, another_prefix: str) -> None:
        """Append every sequence and document of the dataset at ``another_prefix``."""
        other = MMapIndexedDataset(another_prefix)
        if np.dtype(other.dtype) != self._dtype:
            raise ValueError(f"cannot merge {another_prefix}: its dtype is "
                             f"{np.dtype(other.dtype).name}, this builder's is {self._dtype.name}")
        base = len(self._sizes)
        self._sizes.extend(other.sizes.tolist())
        self._doc_idx.extend((base + other.doc_idx[1:]).tolist())
        with open(data_file_path(another_prefix), "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                self._write(block)

    def finalize(self, idx_path: str) -> None:
        """Write the index and move both files to their final names (durably, together)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        sizes = np.asarray(self._sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * self._dtype.itemsize, out=pointers[1:])
        doc_idx = np.asarray(self._doc_idx, dtype=np.int64)

        def write_index(f):
            f.write(_HEADER.pack(MAGIC, VERSION, dtype_code(self._dtype), len(sizes), len(doc_idx)))
            for array in (sizes, pointers, doc_idx):
                f.write(array.tobytes(order="C"))
        tmp_idx, _ = write_temp(idx_path, write_index)
        try:
            remove_quietly(self._bin_path + DIGEST_SUFFIX)  # never describe the new file with an old digest
            publish(self._tmp_path, self._bin_path)
            publish(tmp_idx, idx_path)
        except BaseException:
            remove_quietly(tmp_idx)
            raise
        self._write_digest(idx_path)

    def _write_digest(self, idx_path: str) -> None:
        """``prefix.bin.sha256``: the sha256 of the .bin and the .idx in sha256sum format
        (``sha256sum -c`` checks it)."""
        write_text_durably(self._bin_path + DIGEST_SUFFIX,
                           f"{self._sha256.hexdigest()}  {os.path.basename(self._bin_path)}\n"
                           f"{file_sha256(idx_path)}  {os.path.basename(idx_path)}\n")

    def abort(self) -> None:
        """Stop building and delete the temporary data file."""
        self._file.close()
        remove_quietly(self._tmp_path)


def make_builder(out_bin: str, vocab_size: Optional[int] = None,
                 impl: str = "mmap") -> MMapIndexedDatasetBuilder:
    """A builder for ``out_bin`` with the smallest dtype that holds ``vocab_size`` ids."""
    _check_impl(impl)
    return MMapIndexedDatasetBuilder(out_bin, dtype=best_fitting_dtype(vocab_size))


def make_dataset(path_prefix: str, impl: str = "mmap") -> MMapIndexedDataset:
    """Open the dataset at ``path_prefix`` (``.bin``/``.idx`` without the extension)."""
    _check_impl(impl)
    return MMapIndexedDataset(path_prefix)


def _check_impl(impl: str) -> None:
    if impl != "mmap":
        raise ValueError(f"--dataset-impl {impl!r} is not supported; only 'mmap' is")
