"""--ckpt-format torch_dcp (megatron/checkpointing/torch_dcp.py) in one process: its directory
and keys are Megatron-LM's (a bare DCP checkpoint of `model.<Megatron-Core state_dict name>`
with `iteration`, `checkpoint_version` and None `_extra_state` entries; no common.pt or
metadata.json), the weights load back, a checkpoint whose non-tensor entry is not plain data
is refused without running it, and the flag is accepted with --use-torch-fsdp2.
(tests/distributed/test_fsdp.py trains, saves and resumes it across layouts;
tests/distributed/test_mcore_interop.py exchanges it with Megatron-Core's GPTModel.)"""
import os

import pytest
import torch

from megatron.checkpointing import api, dist_io, torch_dcp, torch_dist
from megatron.checkpointing.io import CheckpointError
from megatron.config import ModelConfig
from megatron.model import GPTModel
from megatron.mpu.parallel_state import single_process_state


def _llama(seed: int) -> GPTModel:
    cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=8,
                      max_position_embeddings=8, padded_vocab_size=32, normalization="RMSNorm",
                      activation="swiglu", position_embedding_type="rope", ffn_hidden_size=32,
                      group_query_attention=True, num_query_groups=2, add_bias_linear=False,
                      untie_embeddings_and_output_weights=True)
    model = GPTModel(cfg)
    model.init_weights(seed)
    return model


def _save(tmp_path, model) -> str:
    directory = os.path.join(str(tmp_path), "iter_0000001")
    torch_dist.save_model_weights(directory, [model], 2, single_process_state(),
                                  fmt=torch_dcp.FORMAT)
    return directory


def test_directory_and_keys_are_megatron_lm_s(tmp_path):
    directory = _save(tmp_path, _llama(1))
    assert sorted(os.listdir(directory)) == [".metadata", "__0_0.distcp", dist_io.CHECKSUMS]
    assert api.detect_directory(directory) is torch_dcp.FORMAT
    assert not torch_dist.FORMAT.detect(directory)
    keys = set(dist_io.SafeReader(directory).read_metadata().state_dict_metadata)
    for key in ("model.embedding.word_embeddings.weight", "model.output_layer.weight",
                "model.decoder.final_layernorm.weight",
                "model.decoder.layers.1.input_layernorm.weight",
                "model.decoder.layers.1.pre_mlp_layernorm.weight",
                "model.decoder.layers.0.self_attention.linear_qkv.weight",
                "model.decoder.layers.0.self_attention.linear_qkv._extra_state",
                "model.decoder.layers.0.mlp.linear_fc2._extra_state",
                "model.output_layer._extra_state", "iteration", "checkpoint_version", "common"):
        assert key in keys, (key, sorted(keys))
    assert not any(".layer_norm_" in key or key.startswith("decoder.") for key in keys)
    stored = torch_dcp.read_entries(directory)
    assert stored == {}  # the weights alone: no counters, config or optimizer


def test_weights_load_back(tmp_path):
    model, other = _llama(1), _llama(2)
    directory = _save(tmp_path, model)
    name = "language_model.embedding.word_embeddings.weight"
    assert not torch.equal(model.state_dict()[name], other.state_dict()[name])
    torch_dist.load_model_weights(directory, [other], 2, single_process_state(),
                                  fmt=torch_dcp.FORMAT)
    for (key, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), key


class _Hostile:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_entry_that_is_not_plain_data_is_refused_unrun(tmp_path):
    import torch.distributed.checkpoint as dcp
    directory = os.path.join(str(tmp_path), "iter_0000003")
    marker = os.path.join(str(tmp_path), "ran")
    dcp.save({"model": {"embedding.word_embeddings.weight": torch.zeros(4, 2)},
              "iteration": 3, "args": _Hostile(marker)}, checkpoint_id=directory, no_dist=True)
    assert not os.path.exists(marker)  # pickled, not run; unpickling it would create it
    assert api.detect_directory(directory) is torch_dcp.FORMAT
    with pytest.raises(CheckpointError, match="'args' entry cannot be read as plain data"):
        torch_dcp.read_entries(directory)
    assert not os.path.exists(marker)


@pytest.mark.parametrize("fmt", ["torch_dist", "torch_dcp"])
def test_fsdp_saves_in_either_dcp_format(fmt):
    from megatron.arguments import parse_args
    from tests.gpt_setup import tiny_gpt_argv
    config, _ = parse_args(tiny_gpt_argv("data", "cache", "--use-torch-fsdp2", "--save", "x",
                                         "--ckpt-format", fmt, mbs=1), world_size=2)
    assert config.checkpoint.ckpt_format == fmt
