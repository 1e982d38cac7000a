"""The CUDA kernel sources compile with a bare nvcc (no torch headers, no GPU).

The torch binding (bindings_cuda.cpp) needs a CUDA build of torch and is only
compiled where one exists; the .cu files must build anywhere nvcc does.
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "csrc" / "fused"
CUDA_FILES = sorted(CSRC.glob("*.cu"))
ALLOWED_SYSTEM_HEADERS = {"cuda_runtime.h", "cuda_fp16.h", "cuda_bf16.h"}
# The flags torch's extension builder passes to nvcc that change what compiles.
TORCH_NVCC_DEFINES = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                      "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__"]


def find_nvcc():
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").is_file():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def includes(path: Path):
    """(name, is_system) for each #include line of a file."""
    pattern = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)
    return [(name, bracket == "<") for bracket, name in pattern.findall(path.read_text())]


def test_cuda_sources_exist():
    names = {p.name for p in CUDA_FILES}
    assert {"softmax_cuda.cu", "layer_norm_cuda.cu", "rms_norm_cuda.cu"} <= names


def test_cuda_sources_include_only_cuda_headers():
    """.cu files and the local headers they pull in use CUDA headers only."""
    seen, todo = set(), list(CUDA_FILES)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name, is_system in includes(path):
            if is_system:
                assert name in ALLOWED_SYSTEM_HEADERS, f"{path.name} includes <{name}>"
            else:
                local = CSRC / name
                assert local.is_file(), f"{path.name} includes missing \"{name}\""
                todo.append(local)


@pytest.mark.parametrize("source", CUDA_FILES, ids=lambda p: p.name)
def test_nvcc_compiles(source, tmp_path):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    cmd = [nvcc, "-c", str(source), "-o", str(tmp_path / (source.stem + ".o")),
           "-std=c++17", "-O2", "-I", str(CSRC), "-Werror", "all-warnings", *TORCH_NVCC_DEFINES]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / (source.stem + ".o")).stat().st_size > 0
