"""Index helpers for GPT datasets: a C++ module built on first use, with numpy twins.

`build_sample_idx` and `build_blending_indices` run the C++ code in
``csrc/helpers.cpp`` when it can be compiled (pybind11 and a C++ compiler) and
the pure numpy/Python versions otherwise; both give identical arrays.

The module is compiled once per source version into a cache directory
(``$MEGATRON_HELPERS_BUILD_DIR``, default ``~/.cache/megatron/helpers``), under a
file lock so that one process compiles while the others wait.  Any build
failure gives one warning and the fallback.  ``MEGATRON_NO_CPP_HELPERS=1``
forces the fallback.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import socket
import subprocess
import sysconfig
import warnings
from pathlib import Path
from types import ModuleType

import numpy as np

from megatron.files import publish

_SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "helpers.cpp"
_MODULE_NAME = "megatron_data_helpers"
_CXX_FLAGS = ["-O3", "-shared", "-std=c++17", "-fPIC", "-ffp-contract=off"]
_INT32_MAX = np.iinfo(np.int32).max

_cpp_module: ModuleType | None = None
_cpp_tried = False


# ----------------------------------------------------------------------------
# Building and loading the C++ module
# ----------------------------------------------------------------------------

def _build_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "megatron" / "helpers"
    return Path(os.environ.get("MEGATRON_HELPERS_BUILD_DIR", default))


def _compile_command(output: str) -> list[str]:
    import pybind11  # imported here: a missing pybind11 is a build failure, not an import error

    includes = [f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}"]
    cxx = os.environ.get("CXX", "c++")
    return [cxx, *_CXX_FLAGS, *includes, str(_SOURCE), "-o", output]


def _library_path(build_dir: Path) -> Path:
    """Path of the compiled module; the name changes with the source and flags."""
    digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_CXX_FLAGS).encode()).hexdigest()[:12]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return build_dir / f"{_MODULE_NAME}_{digest}{suffix}"


def _compile(library: Path) -> None:
    """Compile to a temporary name next to `library`, then rename it into place."""
    tmp = f"{library}.tmp.{socket.gethostname()}.{os.getpid()}"  # unique even on a shared filesystem
    try:
        proc = subprocess.run(_compile_command(tmp), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"compiler exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        publish(tmp, str(library))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _build_locked(build_dir: Path) -> Path:
    """Return the compiled module path, compiling it under a file lock if needed."""
    library = _library_path(build_dir)
    if library.exists():
        return library
    build_dir.mkdir(parents=True, exist_ok=True)
    import fcntl

    with open(build_dir / f"{_MODULE_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first process compiles, the others wait here
        try:
            if not library.exists():
                _compile(library)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return library


def _import_library(library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_cpp_helpers() -> ModuleType | None:
    """The compiled helper module, or None (with one warning) when it cannot be built."""
    global _cpp_module, _cpp_tried
    if os.environ.get("MEGATRON_NO_CPP_HELPERS", "0") not in ("", "0"):
        return None
    if not _cpp_tried:
        _cpp_tried = True
        try:
            _cpp_module = _import_library(_build_locked(_build_dir()))
        except Exception as exc:  # any failure: compiler, headers, permissions, import
            warnings.warn(
                f"megatron: could not build the C++ dataset helpers ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); using the slower numpy fallback "
                f"(set MEGATRON_NO_CPP_HELPERS=1 to silence this)",
                RuntimeWarning,
                stacklevel=2,
            )
            _cpp_module = None
    return _cpp_module


def _reset_for_tests() -> None:
    """Forget the loaded module so that the next call tries to build again."""
    global _cpp_module, _cpp_tried
    _cpp_module, _cpp_tried = None, False


# ----------------------------------------------------------------------------
# Sample index
# ----------------------------------------------------------------------------

def num_samples_for(num_epochs: int, tokens_per_epoch: int, seq_length: int) -> int:
    """Samples of seq_length + 1 tokens (sharing one boundary token) in num_epochs epochs."""
    return (num_epochs * tokens_per_epoch - 1) // seq_length


def _check_sample_idx_args(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    if seq_length < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    if num_epochs < 1:
        raise ValueError(f"num_epochs must be >= 1, got {num_epochs}")
    if tokens_per_epoch < 2:
        raise ValueError(f"tokens_per_epoch must be >= 2, got {tokens_per_epoch}: the documents are (nearly) empty")
    if np.ndim(sizes) != 1 or np.ndim(doc_idx) != 1:
        raise ValueError("build_sample_idx: sizes and doc_idx must be 1-D arrays")


def build_sample_idx_numpy(sizes, doc_idx, seq_length: int, num_epochs: int, tokens_per_epoch: int) -> np.ndarray:
    """Numpy twin of the C++ build_sample_idx (identical output)."""
    _check_sample_idx_args(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    sizes = np.asarray(sizes)
    doc_idx = np.asarray(doc_idx)
    num_samples = num_samples_for(num_epochs, tokens_per_epoch, seq_length)
    out_dtype = _sample_idx_dtype(doc_idx)
    if doc_idx.size and (doc_idx.min() < 0 or doc_idx.max() >= sizes.shape[0]):
        bad = doc_idx[(doc_idx < 0) | (doc_idx >= sizes.shape[0])][0]
        raise ValueError(f"build_sample_idx: doc_idx holds document id {bad} outside [0, {sizes.shape[0]})")
    result = np.zeros((num_samples + 1, 2), dtype=out_dtype)  # sample 0 starts at (0, 0)
    if num_samples == 0:
        return result
    lengths = sizes[doc_idx].astype(np.int64)
    ends = np.cumsum(lengths)  # end position (exclusive) of each document
    starts = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length  # samples 1..n
    # The document holding global token p is the first whose end exceeds p.
    position = np.searchsorted(ends, starts, side="right")
    if position[-1] >= len(ends):
        raise ValueError("build_sample_idx: doc_idx holds fewer tokens than num_epochs * tokens_per_epoch")
    result[1:, 0] = position
    result[1:, 1] = starts - (ends[position] - lengths[position])
    return result


def _sample_idx_dtype(doc_idx) -> type:
    """Megatron's int32, or int64 when doc_idx is too long for int32 positions."""
    return np.int32 if len(doc_idx) <= _INT32_MAX else np.int64


def build_sample_idx(sizes, doc_idx, seq_length: int, num_epochs: int, tokens_per_epoch: int) -> np.ndarray:
    """Start (position in doc_idx, offset in document) of every sample: [num_samples + 1, 2].

    Sample s spans tokens s*seq_length .. (s+1)*seq_length (inclusive) of the
    documents of `doc_idx` laid end to end; row s + 1 is where sample s ends.
    The dtype is int32 like Megatron's, int64 only when doc_idx is huge.
    """
    module = load_cpp_helpers()
    if module is None:
        return build_sample_idx_numpy(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    _check_sample_idx_args(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    sizes = np.ascontiguousarray(sizes, dtype=np.int32)
    doc_idx = np.asarray(doc_idx)
    doc_dtype = doc_idx.dtype if doc_idx.dtype in (np.int32, np.int64) else np.int64
    doc_idx = np.ascontiguousarray(doc_idx, dtype=doc_dtype)  # int32 doc_idx is read without a copy
    num_samples = num_samples_for(num_epochs, tokens_per_epoch, seq_length)
    use_int64 = _sample_idx_dtype(doc_idx) is np.int64
    return module.build_sample_idx(sizes, doc_idx, seq_length, num_samples, use_int64)


# ----------------------------------------------------------------------------
# Blending indices
# ----------------------------------------------------------------------------

def _check_blending_args(dataset_index, dataset_sample_index, weights, num_datasets, size):
    if not 1 <= num_datasets <= 256:
        raise ValueError(f"blending needs 1..256 datasets (dataset_index is uint8), got {num_datasets}")
    if len(weights) != num_datasets:
        raise ValueError(f"got {len(weights)} weights for {num_datasets} datasets")
    for name, array, dtype in (("dataset_index", dataset_index, np.uint8),
                               ("dataset_sample_index", dataset_sample_index, np.int64)):
        if not isinstance(array, np.ndarray) or array.dtype != dtype or not array.flags.c_contiguous:
            raise ValueError(f"{name} must be a C-contiguous numpy {np.dtype(dtype).name} array")
        if not array.flags.writeable or array.size < size:
            raise ValueError(f"{name} must be writeable and hold at least size={size} entries")


def build_blending_indices_numpy(dataset_index, dataset_sample_index, weights, num_datasets: int, size: int) -> None:
    """Python twin of the C++ build_blending_indices (identical output, slower)."""
    _check_blending_args(dataset_index, dataset_sample_index, weights, num_datasets, size)
    w = [float(x) for x in weights]
    counts = [0] * num_datasets
    chosen = [0] * size
    taken = [0] * size
    others = range(1, num_datasets)
    for i in range(size):
        scale = float(i) if i > 1 else 1.0
        best, best_error = 0, w[0] * scale - counts[0]
        for d in others:
            error = w[d] * scale - counts[d]
            if error > best_error:
                best, best_error = d, error
        chosen[i] = best
        taken[i] = counts[best]
        counts[best] += 1
    dataset_index[:size] = chosen
    dataset_sample_index[:size] = taken


def build_blending_indices(dataset_index, dataset_sample_index, weights, num_datasets: int, size: int) -> None:
    """Fill dataset_index (uint8) and dataset_sample_index (int64) for `size` blended samples.

    Sample i goes to the dataset d with the largest `weights[d] * max(i, 1) - count[d]`
    (ties to the lower index), and is that dataset's count[d]-th sample.
    """
    module = load_cpp_helpers()
    if module is None:
        build_blending_indices_numpy(dataset_index, dataset_sample_index, weights, num_datasets, size)
        return
    _check_blending_args(dataset_index, dataset_sample_index, weights, num_datasets, size)
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    module.build_blending_indices(dataset_index, dataset_sample_index, weights, num_datasets, size)
