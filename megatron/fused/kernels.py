"""Build and load the C++/CUDA fused kernels in `csrc/fused` on first use.

Nothing is compiled at import time. The first call that needs a kernel (or an
explicit `load_fused_kernels()`) builds the extensions with
`torch.utils.cpp_extension.load` (ninja) into a cache directory:

- `megatron_fused_cpu`: always (C++ with `at::parallel_for`);
- `megatron_fused_cuda`: only when `torch.cuda.is_available()` and CUDA_HOME is set.

Cache: `$MEGATRON_FUSED_BUILD_DIR`, else `~/.cache/megatron_fused` (or
`$XDG_CACHE_HOME/megatron_fused`). Each build lives in a folder named after a
hash of the sources, flags, compiler and torch/Python versions; a finished build
leaves a `BUILD_OK` stamp, and later processes import the library directly
(milliseconds, no ninja). One process builds while the others wait on a file
lock in that folder, so torchrun ranks share one compilation. The lock is
released by the kernel when its holder dies; torch's own lock file, which a
killed build leaves behind, is removed under it.

The CPU library is built for one instruction set, the best this CPU has (AVX-512,
else AVX2 + FMA, else the x86-64 baseline), with vectors exactly one register wide
(csrc/fused/cpu_lanes.h). `MEGATRON_CPU_ISA=avx2|avx512|baseline` builds and loads
another one instead (its own cached build), so that one machine can run and time
each instruction set's code; `cpu_description()` names the CPU and the ISA in use.

Without a cached build, a module of the same name installed by setup.py (built
from `fused_extension_sources()` with `fused_extension_cflags()`) is used as is.

`MEGATRON_DISABLE_FUSED_BUILD=1` forbids compiling (as if there were no
compiler); a library already built (cache or setup.py) is still used. When a build
fails, or is forbidden, one warning gives the short reason and every fused op
falls back to plain PyTorch: a missing compiler never stops training.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import os
import platform
import re
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc" / "fused"
CPU_EXTENSION = "megatron_fused_cpu"
CUDA_EXTENSION = "megatron_fused_cuda"
CPU_SOURCES = ("cpu_math.cpp", "softmax_cpu.cpp", "layer_norm_cpu.cpp", "rms_norm_cpu.cpp",
               "elementwise_cpu.cpp", "cpu_caches.cpp", "attention_cpu.cpp",
               "attention_bf16_cpu.cpp", "moe_cpu.cpp", "bindings_cpu.cpp")
CUDA_SOURCES = ("bindings_cuda.cpp", "softmax_cuda.cu", "layer_norm_cuda.cu", "rms_norm_cuda.cu")
HEADERS = ("cpu_math.h", "cpu_lanes.h", "cpu_kernels.h", "cpu_rows.h", "attention_rows.h",
           "bindings_common.h", "fused_cuda.h", "cuda_common.cuh", "norm_cuda.cuh")
# -fopenmp: at::parallel_for is an inline template over torch's OpenMP pool; compiled
# without it the kernels would run on one thread.
CPU_CFLAGS = ("-O3", "-fopenmp")
LDFLAGS = ("-fopenmp",)
CUDA_CFLAGS = ("-O3",)
DISABLE_ENV = "MEGATRON_DISABLE_FUSED_BUILD"
# The CPU extension is built for one instruction set: the best this CPU has, or the one
# MEGATRON_CPU_ISA=avx2|avx512|baseline names (so that a machine with AVX-512 can run and
# time the AVX2 code). Each has its own cached build.
ISA_ENV = "MEGATRON_CPU_ISA"
ISA_CFLAGS = {"avx512": ("-march=x86-64-v4",), "avx2": ("-march=x86-64-v3",), "baseline": ()}
# The CPU flags (/proc/cpuinfo) each ISA's code needs.
ISA_CPU_FLAGS = {"avx2": ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"),
                 "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd")}
BUILD_DIR_ENV = "MEGATRON_FUSED_BUILD_DIR"
_STAMP = "BUILD_OK"
_API = ("scaled_upper_triang_masked_softmax_forward", "scaled_masked_softmax_forward",
        "layer_norm_forward", "layer_norm_backward", "rms_norm_forward", "rms_norm_backward",
        "set_poison_outputs")

_lock = threading.Lock()
_modules: dict[str, ModuleType | None] = {}  # name -> module, or None after a failure


def fused_extension_sources() -> list[str]:
    """Absolute paths of the C++ sources of the CPU extension (for setup.py)."""
    return [str(CSRC_DIR / name) for name in CPU_SOURCES]


def fused_extension_cflags() -> list[str]:
    """Compiler flags the CPU extension is built with (for setup.py): for this machine's
    best instruction set, or MEGATRON_CPU_ISA's."""
    return list(_cpu_cflags())


def fused_extension_ldflags() -> list[str]:
    """Linker flags the CPU extension is built with (for setup.py)."""
    return list(LDFLAGS)


@functools.lru_cache(maxsize=None)
def _cpu_info() -> tuple[str, frozenset[str]]:
    """(model name, flag set) of this CPU from /proc/cpuinfo; ("unknown", {}) elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown", frozenset()
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.MULTILINE)
    return (model.group(1).strip() if model else "unknown",
            frozenset(flags.group(1).split()) if flags else frozenset())


def cpu_model() -> str:
    """This CPU's model name (as /proc/cpuinfo gives it)."""
    return _cpu_info()[0]


def _supported(flags: frozenset[str]) -> list[str]:
    return [isa for isa in ("avx512", "avx2") if all(f in flags for f in ISA_CPU_FLAGS[isa])] + [
        "baseline"]


def _best_isa(flags: frozenset[str]) -> str:
    return _supported(flags)[0]


def supported_isas() -> list[str]:
    """The instruction sets this CPU can run our kernels in, best first (avx512, avx2,
    baseline): the values MEGATRON_CPU_ISA may take here."""
    return _supported(_cpu_info()[1])


def requested_isa() -> str:
    """MEGATRON_CPU_ISA: avx2, avx512, baseline or default (unset); a clear error for other
    values."""
    isa = os.environ.get(ISA_ENV, "").strip().lower() or "default"
    if isa not in ISA_CFLAGS and isa != "default":
        raise ValueError(f"{ISA_ENV}={isa!r} is not one of {sorted(ISA_CFLAGS) + ['default']}")
    return isa


def cpu_isa() -> str:
    """The instruction set the CPU kernels are built for: MEGATRON_CPU_ISA, else the best
    this CPU has (avx512, avx2 or baseline). An error if the CPU lacks the one asked for."""
    isa, flags = requested_isa(), _cpu_info()[1]
    if isa == "default":
        return _best_isa(flags)
    missing = [f for f in ISA_CPU_FLAGS.get(isa, ()) if flags and f not in flags]
    if missing:
        raise ValueError(f"{ISA_ENV}={isa}: this CPU lacks {missing}; use "
                         f"{ISA_ENV}={_best_isa(flags)} or leave it unset")
    return isa


def cpu_description() -> str:
    """One line naming the CPU, our kernels' ISA and torch's (for benchmarks and logs)."""
    forced = f" ({ISA_ENV})" if requested_isa() != "default" else ""
    return (f"CPU {cpu_model()}, our kernels {cpu_isa()}{forced}, torch kernels "
            f"{torch.backends.cpu.get_cpu_capability()}")


def _cpu_cflags() -> tuple[str, ...]:
    return CPU_CFLAGS + ISA_CFLAGS[cpu_isa()]


def build_root() -> Path:
    """Folder holding the cached builds."""
    env = os.environ.get(BUILD_DIR_ENV)
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "megatron_fused"


@functools.lru_cache(maxsize=None)
def _want_cuda() -> bool:
    if not torch.cuda.is_available():
        return False
    from torch.utils.cpp_extension import CUDA_HOME
    return CUDA_HOME is not None


def _extension_specs() -> dict[str, dict]:
    return {
        CPU_EXTENSION: dict(sources=CPU_SOURCES, cflags=_cpu_cflags(), cuda=False),
        CUDA_EXTENSION: dict(sources=CUDA_SOURCES, cflags=CUDA_CFLAGS, cuda=True),
    }


def _build_key(name: str, spec: dict) -> str:
    """Hash of everything that changes the built library."""
    h = hashlib.sha256()
    for file in sorted(set(spec["sources"]) | set(HEADERS)):
        h.update(file.encode())
        h.update((CSRC_DIR / file).read_bytes())
    parts = [name, torch.__version__, sys.version, " ".join(spec["cflags"]),
             os.environ.get("CXX", ""), sys.platform]
    if spec["cuda"]:
        capabilities = [torch.cuda.get_device_capability(i)
                        for i in range(torch.cuda.device_count())]
        parts += [str(torch.version.cuda), str(capabilities),
                  os.environ.get("TORCH_CUDA_ARCH_LIST", "")]
    h.update("\0".join(parts).encode())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def cpu_kernels_version() -> str:
    """The hash of our CPU kernels' sources and build flags for this ISA: a measured choice
    between them and a plain path holds only for this version (megatron/fused/choice.py)."""
    return _build_key(CPU_EXTENSION, _extension_specs()[CPU_EXTENSION])


@contextlib.contextmanager
def _file_lock(path: Path):
    """Exclusive lock on `path` across processes (no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _import_library(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_stamp(build_dir: Path, key: str) -> None:
    from megatron.files import write_text_durably  # here: setup.py loads this file on its own
    write_text_durably(str(build_dir / _STAMP), key + "\n")


def _compile(name: str, spec: dict, build_dir: Path, verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension
    sources = [str(CSRC_DIR / s) for s in spec["sources"]]
    kwargs = dict(extra_cuda_cflags=list(spec["cflags"])) if spec["cuda"] else {}
    host_cflags = CPU_CFLAGS if spec["cuda"] else spec["cflags"]
    return cpp_extension.load(
        name=name, sources=sources, extra_cflags=list(host_cflags), extra_ldflags=list(LDFLAGS),
        extra_include_paths=[str(CSRC_DIR)], build_directory=str(build_dir),
        with_cuda=spec["cuda"], verbose=verbose, **kwargs)


def _clear_stale_baton(build_dir: Path) -> None:
    """torch's own build lock (`lock`, a file whose existence is the lock) outlives a
    killed build, and the next build would wait for it forever. Our flock is held
    here, so no other build is running: any such file is stale."""
    baton = build_dir / "lock"
    if baton.exists():
        baton.unlink()
        _warn(f"removed a stale build lock {baton} left by a killed build")


def _prebuilt(name: str) -> ModuleType:
    """The module setup.py installed; the CPU one only if built for the ISA wanted here."""
    module = importlib.import_module(name)
    built_for = getattr(module, "isa", None)
    if name == CPU_EXTENSION and built_for != cpu_isa():
        raise ImportError(f"the installed {name} is built for {built_for}, this process "
                          f"runs {cpu_isa()}; reinstall it or remove it to build on first use")
    return module


def _load_or_build(name: str, spec: dict, verbose: bool) -> ModuleType:
    """Import the cached library of `name`, building it first if needed."""
    key = _build_key(name, spec)
    build_dir = build_root() / f"{name}-{key}"
    library = build_dir / f"{name}.so"
    if (build_dir / _STAMP).is_file() and library.is_file():
        return _import_library(name, library)
    if importlib.util.find_spec(name) is not None:  # pre-built by setup.py
        return _prebuilt(name)
    if os.environ.get(DISABLE_ENV, "0") not in ("", "0"):
        raise RuntimeError(f"compiling is disabled by {DISABLE_ENV}=1")
    build_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(build_dir / "build.lock"):
        if (build_dir / _STAMP).is_file() and library.is_file():
            return _import_library(name, library)  # another process built it meanwhile
        _clear_stale_baton(build_dir)
        module = _compile(name, spec, build_dir, verbose)
        _write_stamp(build_dir, key)
        return module


def _short_reason(exc: BaseException) -> str:
    """First compiler error line of a failed build (else the first line of the message)."""
    text = str(exc) or type(exc).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    diagnostics = [ln for ln in lines if re.search(r"\berror:", ln)]  # compiler lines
    errors = [ln for ln in lines if re.search(r"\berror\b", ln, re.IGNORECASE)]
    reason = (diagnostics or errors or lines or [type(exc).__name__])[0]
    return reason if len(reason) <= 300 else reason[:297] + "..."


def _warn(message: str) -> None:
    try:  # a warning must never stop training, even under -W error
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    except Warning:
        print(f"WARNING: {message}", file=sys.stderr)


def _load(name: str, verbose: bool) -> ModuleType | None:
    """Module `name`, loading or building it once per process; None on failure."""
    if name in _modules:  # fast path for every call after the first
        return _modules[name]
    with _lock:
        if name in _modules:
            return _modules[name]
        try:
            module = _load_or_build(name, _extension_specs()[name], verbose)
            missing = [fn for fn in _API if not hasattr(module, fn)]
            if missing:
                raise ImportError(f"{name} lacks {missing}; remove the stale build")
        except Exception as exc:  # noqa: BLE001 - any build failure means fallback
            module = None
            _warn(f"fused kernels: {name} unavailable ({_short_reason(exc)}); "
                  "using plain PyTorch ops instead")
        _modules[name] = module
        return module


def load_fused_kernels(verbose: bool = False) -> bool:
    """Build (if needed) and load the fused kernels for this machine.

    Loads the CPU extension, and the CUDA one when CUDA is usable. Returns True
    when every extension that applies here is loaded. Never raises for a failed
    build; it warns once and the fused ops use plain PyTorch.
    """
    ok = _load(CPU_EXTENSION, verbose) is not None
    if _want_cuda():
        ok = _load(CUDA_EXTENSION, verbose) is not None and ok
    return ok


def fused_kernels_available(device_type: str | None = None) -> bool:
    """Whether the kernels are loaded already (never builds).

    device_type: "cpu" or "cuda"; None means every extension that applies here.
    """
    names = {"cpu": [CPU_EXTENSION], "cuda": [CUDA_EXTENSION]}.get(device_type or "")
    if names is None:
        names = [CPU_EXTENSION] + ([CUDA_EXTENSION] if torch.cuda.is_available() else [])
    return all(_modules.get(n) is not None for n in names)


def get_extension(device_type: str) -> ModuleType | None:
    """The kernel module for tensors on `device_type`, built on first use; None if unusable."""
    if device_type == "cpu":
        return _load(CPU_EXTENSION, verbose=False)
    if device_type == "cuda" and _want_cuda():
        return _load(CUDA_EXTENSION, verbose=False)
    return None


def set_poison_outputs(enabled: bool) -> None:
    """Fill kernel outputs with NaN before each kernel runs (catches unwritten elements).

    Applies to the extensions already loaded; meant for tests.
    """
    for module in _modules.values():
        if module is not None:
            module.set_poison_outputs(bool(enabled))
