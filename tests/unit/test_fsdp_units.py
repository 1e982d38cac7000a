"""megatron.distributed.fsdp.expert_units: which sub-modules of a layer FSDP shards over the
expert-data-parallel group (pure: modules only, no process group), and the refusals of
pretrain_gpt.py --use-torch-fsdp2 (one line, exit 2)."""
import os
import subprocess
import sys

import pytest
import torch

from megatron.distributed.fsdp import expert_units
from tests.conftest import ROOT
from tests.gpt_setup import tiny_gpt_argv


def _expert_linear():
    linear = torch.nn.Linear(2, 2)
    for p in linear.parameters():
        p.expert_parallel = True
    return linear


def _layer():
    layer = torch.nn.Module()
    layer.attention = torch.nn.Linear(2, 2)
    layer.mlp = torch.nn.Module()
    layer.mlp.router = torch.nn.Linear(2, 4)
    layer.mlp.experts = torch.nn.Module()
    layer.mlp.experts.fc1 = _expert_linear()
    layer.mlp.experts.fc2 = _expert_linear()
    layer.mlp.experts.empty = torch.nn.Identity()
    layer.mlp.shared_experts = torch.nn.Linear(2, 2)  # dense: sharded with the layer
    return layer


def test_the_outermost_all_expert_module_is_the_unit():
    layer = _layer()
    assert expert_units(layer) == [layer.mlp.experts]


def test_a_module_mixing_expert_and_dense_parameters_is_not_a_unit():
    layer = _layer()
    layer.mlp.experts.bias = torch.nn.Parameter(torch.zeros(2))  # dense, inside the experts
    assert expert_units(layer) == [layer.mlp.experts.fc1, layer.mlp.experts.fc2]


def test_a_dense_layer_has_no_expert_unit():
    layer = _layer()
    del layer.mlp.experts
    assert expert_units(layer) == []


@pytest.mark.parametrize("flags, words", [
    (["--use-distributed-optimizer"], ["--use-torch-fsdp2", "--use-distributed-optimizer"]),
    (["--save", "ckpt", "--ckpt-format", "torch"], ["--ckpt-format torch", "torch_dist"]),
    (["--tensor-model-parallel-size", "4"], ["--use-torch-fsdp2", "context-parallel size of 1"]),
])
def test_pretrain_gpt_refuses_what_fsdp_cannot_serve_in_one_line(flags, words, tmp_path):
    """`torchrun --nproc_per_node 4 pretrain_gpt.py --use-torch-fsdp2 ...` as a user launches
    it (WORLD_SIZE 4): each rank stops before any process group with one line and exit 2."""
    env = dict(os.environ, WORLD_SIZE="4", RANK="0", LOCAL_RANK="0")
    argv = tiny_gpt_argv(tmp_path / "data", tmp_path / "cache", "--use-torch-fsdp2", *flags)
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *map(str, argv)],
                          env=env, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert all(word in err for word in words), err
