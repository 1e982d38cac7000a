"""Imported by the benchmarks before torch: with MEGATRON_CPU_ISA=avx2 (or baseline) torch's
own CPU kernels (ATen, oneDNN, MKL) are held to the same instruction set as ours, so that
an AVX-512 machine times both sides as an AVX2 machine would run them. Values already set
in the environment are kept."""
import os

TORCH_ISA_ENV = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "baseline": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                 "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


def hold_torch_to_isa() -> None:
    for name, value in TORCH_ISA_ENV.get(os.environ.get("MEGATRON_CPU_ISA", "").lower(), {}).items():
        os.environ.setdefault(name, value)


hold_torch_to_isa()
