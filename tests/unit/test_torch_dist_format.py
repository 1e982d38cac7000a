"""torch_dist pieces without a process group of several ranks (issue 20).

- blocks / flat rectangles: every TP shard layout and every flat range maps back onto the
  full tensor exactly (checked against megatron.mpu.sharding.shard_tensor), for stacked
  experts too (EP x expert-TP ranks, whole shards and distributed-optimizer pieces);
- Megatron-Core's keys for our names, the expert bias (a persistent buffer) included, and
  a torch_dist resume of an MoE model with an expert bias that continues as the uninterrupted
  run does;
- a weights-only save in one process loads back; a hostile `.metadata` pickle is refused by
  name without running; a corrupted chunk file fails its checksum; a format other than
  --ckpt-format is a one-line error naming the fix.
"""
import os
import pickle

import pytest
import torch

from megatron.checkpointing import api, collectives, dist_io, torch_dist
from megatron.checkpointing.dist_regions import (blocks_of, flat_piece_regions,
                                                 flat_rectangles, placement, split_regions)
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


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (3, 2, 2, 3)])
def test_flat_rectangles_of_every_range(shape):
    numbers = torch.arange(torch.Size(shape).numel()).view(shape)
    for start in range(numbers.numel()):
        for end in range(start + 1, numbers.numel() + 1):
            boxes = flat_rectangles(shape, start, end)
            assert len(boxes) <= 2 * len(shape) - 1
            at, got = 0, []
            for flat, offsets, sizes in boxes:
                assert flat == at
                got.append(numbers[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
                           .reshape(-1))
                at += got[-1].numel()
            assert torch.equal(torch.cat(got), torch.arange(start, end))


@pytest.mark.parametrize("meta", [{"dim": 1, "groups": 2}, {"dim": 2, "groups": 1},
                                  {"dim": None, "groups": 1}])
@pytest.mark.parametrize("ep,etp", [(2, 2), (4, 1), (1, 2)])
def test_expert_regions_rebuild_the_stacked_experts(meta, ep, etp):
    """Each (EP rank, expert-TP rank) holds E / EP experts split over expert TP; its regions
    (whole shards and flat distributed-optimizer pieces) land at their global offsets."""
    meta = dict(meta, expert_dim=0, num_experts=4)
    full = torch.arange(4 * 8 * 6, dtype=torch.float32).view(4, 8, 6) + 1
    flat_out, whole_out = torch.zeros(3, 4, 8, 6), torch.zeros(3, 4, 8, 6)
    for ep_rank in range(ep):
        experts = full[ep_rank * 4 // ep:(ep_rank + 1) * 4 // ep]
        for rank in range(etp):
            shard = shard_tensor(experts, meta, rank, etp).clone() if meta["dim"] is not None \
                else experts.clone()
            place = placement("k", 1, 3, tuple(shard.shape), meta, rank, etp, ep_rank)
            assert place.global_shape == (3, 4, 8, 6)
            half = shard.numel() // 2
            pieces = [flat_piece_regions(place, tuple(shard.shape),
                                         shard.reshape(-1)[lo:hi].clone(), lo)
                      for lo, hi in ((0, half), (half, shard.numel()))]
            for out, regions in ((whole_out, split_regions(place, shard, (0, 0, 0))),
                                 (flat_out, pieces[0] + pieces[1])):
                for view, offsets in regions:
                    out[tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))] = view
    assert torch.equal(whole_out[1], full) and torch.equal(flat_out[1], full)


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
    assert mcore_key("language_model.encoder.layers.2.mlp.experts.linear_fc1.weight") == (
        "decoder.layers.mlp.experts.experts.linear_fc1.weight", 2)
    assert mcore_key("language_model.encoder.layers.2.mlp.router.weight") == (
        "decoder.layers.mlp.router.weight", 2)
    assert mcore_key("language_model.encoder.layers.2.mlp.router.expert_bias") == (
        "decoder.layers.mlp.router.expert_bias", 2)  # Megatron-Core's TopKRouter buffer
    # dense and MoE layers mixed: the layer in the key, no layer axis
    assert mcore_key("language_model.encoder.layers.2.mlp.experts.linear_fc1.weight", False) == (
        "decoder.layers.2.mlp.experts.experts.linear_fc1.weight", None)
    assert mcore_key("language_model.encoder.layers.0.input_layernorm.weight", False) == (
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", None)
    assert mcore_key("language_model.output_layer.weight", False) == ("output_layer.weight", None)


@pytest.mark.parametrize("freq,stacked", [(1, True), (2, False), ([1, 1], False), ([0, 1], False)])
def test_layers_are_stacked_as_megatron_core_stacks_them(freq, stacked):
    """Megatron-Core 0.16.1's TransformerBlock keys each layer on its own when
    moe_layer_freq is a list (even all ones) or an int above 1."""
    from megatron.checkpointing.mcore_keys import stacks_layers
    from megatron.config import MoEConfig
    cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8,
                      max_position_embeddings=8, padded_vocab_size=32,
                      moe=MoEConfig(num_experts=4, moe_layer_freq=freq))
    assert stacks_layers(cfg) == stacked
    assert stacks_layers(ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2,
                                     seq_length=8, max_position_embeddings=8))


def test_mixed_dense_and_moe_weights_round_trip_keyed_per_layer(tmp_path):
    from megatron.config import MoEConfig
    from megatron.mpu.parallel_state import single_process_state
    cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8,
                      max_position_embeddings=8, padded_vocab_size=32,
                      moe=MoEConfig(num_experts=4, moe_ffn_hidden_size=8, moe_layer_freq=[0, 1]))
    model, other = GPTModel(cfg), GPTModel(cfg)
    model.init_weights(1)
    other.init_weights(2)
    directory = os.path.join(str(tmp_path), "iter_0000001")
    torch_dist.save_model_weights(directory, [model], 2, single_process_state())
    stored = dist_io.SafeReader(directory).read_metadata().state_dict_metadata
    assert stored["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"].size == (4, 8, 16)
    assert stored["decoder.layers.0.mlp.linear_fc1.weight"].size == (64, 16)
    assert not any(k.startswith("decoder.layers.mlp") for k in stored)
    torch_dist.load_model_weights(directory, [other], 2, single_process_state())
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name


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
    assert dist_io.is_torch_dist(directory)
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
        dist_io.SafeReader(directory).read_metadata()
    assert not os.path.exists(os.path.join(str(tmp_path), "ran"))
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        f.write(good)
    chunk = os.path.join(directory, "__0_0.distcp")
    data = bytearray(open(chunk, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(chunk, "wb").write(bytes(data))
    with collectives.process_group(), pytest.raises(CheckpointError, match="does not match"):
        dist_io.verify_checksums(directory)


def test_format_mismatch_names_the_flag(tmp_path):
    from megatron.config import CheckpointConfig
    _saved(tmp_path)
    with open(os.path.join(str(tmp_path), "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("1")
    found = api.detect(str(tmp_path))
    with pytest.raises(CheckpointError, match="--ckpt-format torch_dist or "
                                              "--auto-detect-ckpt-format"):
        api.check_format(found, CheckpointConfig())
    assert api.check_format(found, CheckpointConfig(auto_detect_ckpt_format=True)) is found
    assert (found.format, found.directory, found.release) == (
        torch_dist.FORMAT, os.path.join(str(tmp_path), "iter_0000001"), False)


def _bias_model(bias: bool, seed: int):
    from megatron.config import MoEConfig
    cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8,
                      max_position_embeddings=8, padded_vocab_size=32,
                      moe=MoEConfig(num_experts=4, moe_ffn_hidden_size=8,
                                    moe_router_score_function="sigmoid",
                                    moe_router_enable_expert_bias=bias))
    model = GPTModel(cfg)
    model.init_weights(seed)
    for i, layer in enumerate(model.language_model.encoder.layers):
        if bias:
            layer.mlp.router.expert_bias.copy_(torch.arange(4.0) * (seed + i))
    return model


def test_the_expert_bias_is_saved_under_megatron_cores_key(tmp_path, capsys):
    """torch_dist saves the routers' expert bias (a buffer) as Megatron-Core does, [L, E] under
    decoder.layers.mlp.router.expert_bias, and loads it; a checkpoint without one (saved
    before buffers were) loads with a notice, the bias keeping its value."""
    from megatron.mpu.parallel_state import single_process_state
    model, other = _bias_model(True, 1), _bias_model(True, 2)
    directory = os.path.join(str(tmp_path), "iter_0000001")
    torch_dist.save_model_weights(directory, [model], 2, single_process_state())
    stored = dist_io.SafeReader(directory).read_metadata().state_dict_metadata
    assert stored["decoder.layers.mlp.router.expert_bias"].size == (2, 4)
    torch_dist.load_model_weights(directory, [other], 2, single_process_state())
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    without = os.path.join(str(tmp_path), "iter_0000002")
    torch_dist.save_model_weights(without, [_bias_model(False, 3)], 2, single_process_state())
    capsys.readouterr()
    torch_dist.load_model_weights(without, [other], 2, single_process_state())
    assert "holds no decoder.layers.mlp.router.expert_bias" in capsys.readouterr().out
    assert torch.equal(other.state_dict()["language_model.encoder.layers.0.mlp.router.weight"],
                       _bias_model(False, 3).state_dict()[
                           "language_model.encoder.layers.0.mlp.router.weight"])
    bias = other.language_model.encoder.layers[1].mlp.router.expert_bias
    assert torch.equal(bias, model.language_model.encoder.layers[1].mlp.router.expert_bias)


def _moe_run(tmp_path, *extra):
    import pretrain_gpt
    from tests.gpt_setup import losses, one_thread
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "6", "--lr", "1e-2",
            "--lr-warmup-fraction", "0.25", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "500", "--log-interval", "1", "--eval-iters", "0",
            "--num-workers", "0", "--use-cpu-initialization", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--data-cache-path", str(tmp_path / "cache"),
            "--seed", "7", "--num-experts", "4", "--moe-router-topk", "2",
            "--moe-ffn-hidden-size", "32", "--moe-router-score-function", "sigmoid",
            "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-2",
            "--ckpt-format", "torch_dist", *extra]
    with one_thread():
        return losses(pretrain_gpt.main(argv))


def test_an_moe_model_with_an_expert_bias_resumes_from_torch_dist_as_it_ran_on(tmp_path):
    """Saved at iteration 3 and resumed, iterations 4-6 give the uninterrupted run's losses
    (before the expert bias was saved they drifted by 2e-3 at this update rate)."""
    full = _moe_run(tmp_path)
    root = str(tmp_path / "ckpt")
    _moe_run(tmp_path, "--save", root, "--save-interval", "3", "--exit-interval", "3")
    resumed = _moe_run(tmp_path, "--load", root)
    assert len(resumed) == 3
    assert max(abs(a - b) for a, b in zip(resumed, full[3:])) <= 1e-7, (resumed, full)
