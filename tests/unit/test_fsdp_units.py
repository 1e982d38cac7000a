"""megatron.distributed.fsdp.expert_units: which sub-modules of a layer FSDP shards over the
expert-data-parallel group (pure: modules only, no process group)."""
import torch

from megatron.distributed.fsdp import expert_units


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
