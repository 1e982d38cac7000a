"""Multi-token prediction in one process (issue 30, item 2): the flags, where the MTP layers
go on the pipeline, the shift of tokens and labels, the parameters (names, sharding
metadata, Megatron-Core keys), generation without them, and the one-line refusals.
Equality with Megatron-Core: tests/distributed/test_mtp_megatron_core.py; layouts:
tests/distributed/test_mtp_layouts.py."""
import pytest
import torch

from megatron.arguments import parse_args
from megatron.checkpointing.mcore_keys import mcore_key
from megatron.config import ModelConfig
from megatron.model import GPTModel
from megatron.model.moe.router import AuxLossScaler
from megatron.model.mtp import shift_left
from megatron.pipeline.layout import LAYOUT_FLAG, pipeline_layout
from tests.gpt_setup import assert_exits_2_with_one_line

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1",
         "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "1",
         "--position-embedding-type", "rope"]


def _model(**kw):
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8,
                      max_position_embeddings=8, position_embedding_type="rope",
                      hidden_dropout=0.0, attention_dropout=0.0, padded_vocab_size=64,
                      mtp_num_layers=2, **kw)
    model = GPTModel(cfg)
    model.init_weights(5)
    return model


def test_flags_have_megatron_lm_names_and_defaults():
    config, _ = parse_args(FLAGS, world_size=1)
    assert config.model.mtp_num_layers is None and config.model.mtp_loss_scaling_factor == 0.1
    config, _ = parse_args(FLAGS + ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"],
                           world_size=1)
    assert (config.model.mtp_num_layers, config.model.mtp_loss_scaling_factor) == (2, 0.3)
    assert str(config.pipeline_layout()) == "EttmmL"


def test_mtp_layers_go_on_the_loss_stage_before_it():
    assert str(pipeline_layout(4, 2, mtp_num_layers=1)) == "Ett|ttmL"
    assert str(pipeline_layout(4, 2, 2, mtp_num_layers=2)) == "Et|t|t|tmmL"
    assert pipeline_layout(4, 2, mtp_num_layers=1).chunk(1).mtp_layers == 1
    assert pipeline_layout(4, 2, mtp_num_layers=1).num_layers == 4  # m is not a decoder layer


def test_shift_left_fills_zeros_at_the_end():
    t = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert shift_left(t).tolist() == [[2, 3, 4, 0], [6, 7, 8, 0]]
    assert shift_left(shift_left(t)).tolist() == [[3, 4, 0, 0], [7, 8, 0, 0]]


def test_parameters_are_named_and_keyed_as_megatron_core():
    model = _model()
    names = [n for n in model.global_parameter_names() if n.startswith("mtp.")]
    assert "mtp.layers.1.eh_proj.weight" in names and "mtp.layers.0.hnorm.weight" in names
    assert mcore_key("mtp.layers.1.transformer_layer.self_attention.query_key_value.weight") == \
        ("mtp.layers.1.transformer_layer.self_attention.linear_qkv.weight", None)
    assert mcore_key("mtp.layers.0.transformer_layer.input_layernorm.weight") == \
        ("mtp.layers.0.transformer_layer.self_attention.linear_qkv.layer_norm_weight", None)
    assert mcore_key("mtp.layers.0.enorm.weight") == ("mtp.layers.0.enorm.weight", None)
    meta = model.sharding_metadata()
    assert meta["mtp.layers.0.eh_proj.weight"]["dim"] == 0  # column parallel
    assert meta["mtp.layers.0.enorm.weight"]["dim"] is None  # replicated
    assert model.mtp.layers[1].transformer_layer.layer_number == 4  # after the 2 decoder layers


def test_mtp_loss_trains_the_mtp_layers_and_logits_ignore_them():
    model = _model(mtp_loss_scaling_factor=0.5)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    pos, labels = torch.arange(8).expand(2, 8), torch.roll(ids, -1, 1)
    model.eval()
    logits = model(ids, pos)
    assert logits.shape == (2, 8, 64) and not model.mtp.losses
    model.train()
    AuxLossScaler.set_scale(1.0)
    losses = model(ids, pos, labels=labels)
    losses.mean().backward()
    assert model.mtp.losses[0].shape == (2,)
    assert model.mtp.layers[1].eh_proj.weight.grad.abs().sum() > 0
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    AuxLossScaler.set_scale(0.0)  # no MTP gradient: the decoder gets the main loss's only
    model(ids, pos, labels=labels).mean().backward()
    assert model.mtp.layers[0].eh_proj.weight.grad.abs().sum() == 0
    assert not torch.allclose(grads["language_model.encoder.layers.0.mlp.dense_h_to_4h.weight"],
                              model.language_model.encoder.layers[0].mlp.dense_h_to_4h.weight.grad)
    AuxLossScaler.set_scale(1.0)


BAD = {
    "m not on the last stage": (
        ["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2",
         LAYOUT_FLAG, "Et||tm|L"], 2, ["'Et||tm|L'", "must be on the last stage"]),
    "m count differs": (
        ["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2", LAYOUT_FLAG, "Et|tmmL"],
        2, ["2 MTP layers (m)", "--mtp-num-layers is 1"]),
    "learned absolute positions": (
        ["--mtp-num-layers", "1", "--position-embedding-type", "learned_absolute"], 1,
        ["--mtp-num-layers needs --position-embedding-type rope or none", "learned_absolute"]),
    "no depths": (["--mtp-num-layers", "0"], 1, ["--mtp-num-layers must be positive, got 0"]),
}


@pytest.mark.parametrize("flags, world, words", BAD.values(), ids=list(BAD))
def test_bad_settings_exit_2_with_one_line(capsys, flags, world, words):
    assert_exits_2_with_one_line(capsys, lambda: parse_args(FLAGS + flags, world_size=world),
                                 words)


def test_checkpoint_keeps_the_mtp_layers_and_generation_ignores_them(tmp_path):
    from megatron.checkpointing import api
    from megatron.checkpointing.formats import RunState
    from megatron.config import CheckpointConfig, Config, DataConfig
    from megatron.mpu import single_process_state
    from megatron.text_generation import generate
    from megatron.tokenizer import ByteLevelTokenizer
    from tests.unit.test_generation import tiny_model
    from tools import generate_samples_gpt
    model = tiny_model(seed=7, position_embedding_type="rope", mtp_num_layers=1)
    config = Config(model=model.cfg, data=DataConfig(tokenizer_type="ByteLevelTokenizer"),
                    checkpoint=CheckpointConfig(no_save_optim=True, no_save_rng=True))
    root = tmp_path / "ckpt"
    api.save(str(root), 7, RunState([model], config, single_process_state()))
    from megatron.checkpointing.io import load_file
    saved = load_file(str(root / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt"))["model"]
    assert torch.equal(saved["mtp.layers.0.eh_proj.weight"], model.mtp.layers[0].eh_proj.weight)
    records = generate_samples_gpt.main(["--load", str(root), "--prompt", "Once upon",
                                         "--out-seq-length", "8", "--greedy"])
    model.mtp = None  # the same tokens without the MTP layers
    assert [r["tokens"] for r in records] == generate(model, ByteLevelTokenizer(), ["Once upon"],
                                                      8, greedy=True)


def test_log_line_and_tensorboard_have_each_depth_loss(tmp_path, capsys):
    import pretrain_gpt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    argv = FLAGS + ["--mtp-num-layers", "2", "--mock-data", "--tokenizer-type", "NullTokenizer",
                    "--vocab-size", "63", "--train-iters", "3", "--log-interval", "1",
                    "--eval-interval", "2", "--eval-iters", "1", "--num-workers", "0",
                    "--hidden-dropout", "0", "--attention-dropout", "0",
                    "--tensorboard-dir", str(tmp_path / "tb")]
    state = pretrain_gpt.main(argv)
    lines = [line for line in capsys.readouterr().out.splitlines() if "consumed samples" in line]
    assert len(lines) == 3
    for line, history in zip(lines, state.history):
        for name in ("lm loss", "mtp_1 loss", "mtp_2 loss"):
            assert f" {name}: {history[name]:.6E} |" in line, line
    assert line.index("lm loss") < line.index("mtp_1 loss") < line.index("mtp_2 loss")
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("mtp_1 loss")] == [1, 2, 3]
    assert "mtp_2 loss" in events.Tags()["scalars"]
