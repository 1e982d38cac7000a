"""Install the framework: `pip install -e .` (add `[hf]` for Hugging Face tokenizers, `[serve]`
for tools/run_text_generation_server.py, `[harness]` for tasks/eval_harness.py).

C++ kernels (fused softmax / layer norm, dataset index helpers) compile on first
use and are cached. To build the fused CPU kernels ahead of time instead:
`MEGATRON_BUILD_EXTENSIONS=1 pip install -e .` (needs torch already installed).
torch is required but never pinned here: a CUDA build the user installed stays.
"""
import os

from setuptools import find_packages, setup


def extensions():
    if os.environ.get("MEGATRON_BUILD_EXTENSIONS", "0") in ("", "0"):
        return {}, []
    import importlib.util

    from torch.utils.cpp_extension import BuildExtension, CppExtension
    spec = importlib.util.spec_from_file_location(
        "fused_kernels", os.path.join(os.path.dirname(__file__), "megatron", "fused", "kernels.py"))
    fused = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fused)
    ext = CppExtension(fused.CPU_EXTENSION, fused.fused_extension_sources(),
                       extra_compile_args=fused.fused_extension_cflags(),
                       extra_link_args=fused.fused_extension_ldflags())
    return {"build_ext": BuildExtension}, [ext]


cmdclass, ext_modules = extensions()

setup(
    name="megatron-gpt",
    version="0.1.0",
    description="Megatron-style GPT pretraining with tensor, pipeline and data parallelism",
    long_description=open("README.md", encoding="utf-8").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    # Editable installs (`pip install -e .`): the C++ sources in csrc/ and the
    # scripts in tools/ and tasks/ are used from the checkout.
    packages=find_packages(include=["megatron", "megatron.*"]),
    py_modules=["pretrain_gpt"],
    install_requires=["torch>=2.1", "numpy", "regex", "tensorboard", "pybind11", "ninja"],
    extras_require={
        "hf": ["tokenizers", "transformers", "safetensors"],
        "sentencepiece": ["sentencepiece", "tiktoken"],
        "serve": ["flask", "waitress"],
        "harness": ["lm_eval>=0.4,<0.5"],
        "test": ["pytest", "tokenizers", "transformers", "safetensors", "sentencepiece", "tiktoken",
                 "flask", "waitress", "requests", "lm_eval>=0.4,<0.5", "sacremoses", "pyyaml",
                 "matplotlib"],
        "fairseq": ["sacremoses"],
    },
    cmdclass=cmdclass,
    ext_modules=ext_modules,
)
