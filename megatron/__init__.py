"""Megatron-style GPT pretraining on PyTorch.

OpenMP's worker threads (torch's intra-op pool, which our CPU kernels' at::parallel_for
also runs on) sleep between parallel regions unless OMP_WAIT_POLICY is set otherwise.
GNU OpenMP's default spins first; on a loaded 2-core machine 200 small layer-norm +
matmul + GeLU steps took 14-30 s of wall and 8-9 s of CPU with it, 7 s and 3 s with
PASSIVE. This takes effect only where megatron is imported before torch (pretrain_gpt.py,
tools/, tasks/ do so).
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
