"""torch_dist pieces without a process group of several ranks (issue 20).

- blocks / flat rectangles: every TP shard layout and every flat range maps back onto the
  full tensor exactly (checked against megatron.mpu.sharding.shard_tensor);
- Megatron-Core's keys for our names;
- a weights-only save in one process loads back; a hostile `.metadata` pickle is refused by
  name without running; a corrupted chunk file fails its checksum; a format other than
  --ckpt-format is a one-line error naming the fix.
"""
import os
import pickle

import pytest
import torch

from megatron.checkpointing import torch_dist
from megatron.checkpointing.dist_regions import (blocks_of, flat_piece_regions, placement,
                                                 split_regions)
from megatron.checkpointing.io import CheckpointError
from megatron.checkpointing.mcore_keys import mcore_key
from megatron.config import ModelConfig
from megatron.model import GPTModel
from megatron.mpu.sharding import qkv_meta, shard_tensor

LAYOUTS = [({"dim": 0, "groups": 1}, 4), ({"dim": 1, "groups": 1}, 2), ({"dim": 0, "groups": 2}, 2),
           (qkv_meta(2, 4, 3), 2), (qkv_meta(2, 4, 3), 4), ({"dim": None, "groups": 1}, 2)]


def _assemble(full, meta, tp, pieces_of):
    """Write every rank's regions into a zero tensor; it must equal `full`."""
    out = torch.zeros_like(full)
    for rank in range(tp):
        for view, offsets in pieces_of(shard_tensor(full, meta, rank, tp).clone(), rank):
            index = tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))
            out[index] = view
    return out


@pytest.mark.parametrize("meta,tp", LAYOUTS)
def test_regions_of_whole_shards_rebuild_the_full_tensor(meta, tp):
    full = torch.arange(24 * 10, dtype=torch.float32).view(24, 10) + 1

    def pieces(shard, rank):
        place = placement("k", None, 1, tuple(shard.shape), meta, rank, tp)
        return split_regions(place, shard, (0, 0))
    assert torch.equal(_assemble(full, meta, tp, pieces), full)


@pytest.mark.parametrize("meta,tp", LAYOUTS)
@pytest.mark.parametrize("cut", [(0, 7), (3, 3 + 25), (9, 60)])
def test_regions_of_flat_pieces_cover_their_range(meta, tp, cut):
    full = torch.arange(24 * 10, dtype=torch.float32).view(24, 10) + 1

    def pieces(shard, rank):
        place = placement("k", 3, 5, tuple(shard.shape), meta, rank, tp)
        flat = shard.reshape(-1)[cut[0]:cut[1]].clone()
        return [(v[0], o[1:]) for v, o in flat_piece_regions(place, tuple(shard.shape), flat,
                                                             cut[0])]
    assembled = _assemble(full, meta, tp, pieces)
    covered = assembled != 0
    assert torch.equal(assembled[covered], full[covered])
    per_rank = cut[1] - cut[0]
    assert int(covered.sum()) <= per_rank * tp and int(covered.sum()) > 0


def test_blocks_of_grouped_query_replicas():
    meta = qkv_meta(2, 4, 3)  # 2 groups of [2 q heads, k, v], head_dim 3: 24 rows
    assert blocks_of(meta, 9, 1, 4) == [(0, 3, 3), (3, 6, 6)]  # rank 1: q head 1, group 0's kv
    assert blocks_of(meta, 12, 1, 2) == [(0, 12, 12)]


def test_megatron_core_keys():
    assert mcore_key("language_model.encoder.layers.3.input_layernorm.weight") == (
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight", 3)
    assert mcore_key("language_model.encoder.layers.0.mlp.dense_4h_to_h.bias") == (
        "decoder.layers.mlp.linear_fc2.bias", 0)
    assert mcore_key("language_model.embedding.word_embeddings.weight") == (
        "embedding.word_embeddings.weight", None)
    assert mcore_key("language_model.output_layer.weight") == ("output_layer.weight", None)


def _saved(tmp_path):
    cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8,
                      max_position_embeddings=8, padded_vocab_size=32)
    model = GPTModel(cfg)
    model.init_weights(1)
    directory = os.path.join(str(tmp_path), "iter_0000001")
    from megatron.mpu.parallel_state import single_process_state
    torch_dist.save_model_weights(directory, [model], 2, single_process_state())
    return cfg, model, directory


def test_weights_round_trip_and_refusals(tmp_path):
    from megatron.mpu.parallel_state import single_process_state
    cfg, model, directory = _saved(tmp_path)
    assert torch_dist.is_torch_dist(directory)
    other = GPTModel(cfg)
    other.init_weights(2)
    assert not torch.equal(other.state_dict()["language_model.embedding.word_embeddings.weight"],
                           model.state_dict()["language_model.embedding.word_embeddings.weight"])
    torch_dist.load_model_weights(directory, [other], 2, single_process_state())
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    with open(os.path.join(directory, ".metadata"), "rb") as f:
        good = f.read()

    class Hostile:
        def __reduce__(self):
            return (os.system, ("touch " + os.path.join(str(tmp_path), "ran"),))
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        pickle.dump(Hostile(), f)
    with pytest.raises(CheckpointError, match="posix.system is not part of DCP's metadata"):
        torch_dist.SafeReader(directory).read_metadata()
    assert not os.path.exists(os.path.join(str(tmp_path), "ran"))
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        f.write(good)
    chunk = os.path.join(directory, "__0_0.distcp")
    data = bytearray(open(chunk, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(chunk, "wb").write(bytes(data))
    with torch_dist.process_group(), pytest.raises(CheckpointError, match="does not match"):
        torch_dist.verify_checksums(directory)


def test_format_mismatch_names_the_flag(tmp_path):
    from megatron.config import CheckpointConfig
    _saved(tmp_path)
    with open(os.path.join(str(tmp_path), "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("1")
    with pytest.raises(CheckpointError, match="--ckpt-format torch_dist or "
                                              "--auto-detect-ckpt-format"):
        torch_dist.torch_dist_iteration(str(tmp_path), CheckpointConfig())
    found = torch_dist.torch_dist_iteration(str(tmp_path),
                                            CheckpointConfig(auto_detect_ckpt_format=True))
    assert found == (os.path.join(str(tmp_path), "iter_0000001"), False)
