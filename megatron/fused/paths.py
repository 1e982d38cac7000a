"""What the fused ops share: the kernels' constraints, the loaded extension, the CPU
kernels' instruction set, and the log lines naming the path each op takes.

The kernels take float32, bfloat16 or float16 (`KERNEL_DTYPES`) and rows of at most
`MAX_ROW_LENGTH[device type]` (the CUDA kernels stage a softmax or norm row in shared
memory). `announce` prints each (op, path) once per process on rank 0; the norms call it
through `_announce_norm` on every call, which checks its key before building a string.
"""
from __future__ import annotations

import torch

from megatron.fused import kernels as fused_kernels

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Longest softmax row / layer-norm row per device type; None means no limit.
MAX_ROW_LENGTH = {"cpu": None, "cuda": 8192}


def _row_fits(device: torch.device, length: int) -> bool:
    if device.type not in MAX_ROW_LENGTH:
        return False
    limit = MAX_ROW_LENGTH[device.type]
    return length >= 1 and (limit is None or length <= limit)


def _ext(tensor: torch.Tensor):
    module = fused_kernels.get_extension(tensor.device.type)
    if module is None:
        raise RuntimeError(f"fused kernels are not available for device {tensor.device}; "
                           "call attention_softmax/layer_norm, which fall back to PyTorch")
    return module


def cpu_kernels_isa() -> str:
    """The instruction set the loaded CPU kernels were built for (avx512, avx2, baseline)."""
    module = fused_kernels.get_extension("cpu")
    return getattr(module, "isa", "unknown") if module is not None else "not built"


_ANNOUNCED: set = set()


def announce(op: str, path: str) -> None:
    """Prints the path `op` (attention, layer norm, RMSNorm) takes, once per path and
    process, on rank 0; nothing while torch.compile traces (no graph break)."""
    if (op, path) in _ANNOUNCED or torch.compiler.is_compiling():
        return
    _ANNOUNCED.add((op, path))
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f" {op}: {path}", flush=True)


def _announce_norm(op: str, x: torch.Tensor, kernel: bool, fusion: bool, plain: str,
                   declined: bool = False) -> None:
    """announce() for a norm: our kernel (with the CPU's instruction set), or the plain path
    and why (`declined`: the kernel applies, the kernel choice took the plain path). The key
    is checked before any string is built: this runs on every call."""
    key = (op, x.device.type, kernel, fusion, declined)
    if torch.compiler.is_compiling() or key in _ANNOUNCED:
        return
    _ANNOUNCED.add(key)
    if kernel:
        isa = f", {cpu_kernels_isa()}" if x.device.type == "cpu" else ""
        path = f"our {x.device.type.upper()} kernel{isa}"
    else:
        why = ("fusion off" if not fusion else
               "the kernel choice, see its line" if declined and x.device.type == "cpu" else
               f"the {x.device.type.upper()} rule: measured faster, megatron/fused/norms.py"
               if declined and fused_kernels.get_extension(x.device.type) is not None else
               "kernels not built" if fused_kernels.get_extension(x.device.type) is None else
               f"{str(x.dtype)[6:]} [..., {x.shape[-1]}] outside the kernel's constraints")
        path = f"{plain} ({why})"
    announce(op, path)
