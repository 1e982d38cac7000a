"""Megatron checkpoints load here, ours carry what Megatron reads (issue 11, deliverable 5).

Megatron-format files are built by tests/megatron_ckpt.py from the documented format
(versions 1.0, 2.0, 3.0, with and without optimizer state) and must give the logits of
the same weights; our checkpoint, read back by that helper, has every entry Megatron
needs; a hostile pickle in `args` position runs nothing.
"""
import os

import pytest
import torch

from megatron.config import Config, ModelConfig, OptimizerConfig, TrainingConfig
from megatron.model import GPTModel
from megatron.mpu import model_parallel_seed, single_process_state
from megatron.optimizer import MegatronOptimizer, build_lr_scheduler
from megatron.optimizer.optimizer import _param_groups
from megatron.model.positions import sinusoidal_table
from megatron.checkpointing import api
from megatron.checkpointing.formats import RunState
from megatron.checkpointing.io import CheckpointError
from megatron.checkpointing.model_file import read_model_file, to_megatron_layout
from tests.megatron_ckpt import (missing_megatron_entries, read_megatron_checkpoint,
                                 write_megatron_checkpoint)

ARGS = dict(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
            seq_length=16, make_vocab_size_divisible_by=16, padded_vocab_size=64,
            tokenizer_type="GPT2BPETokenizer", tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1, consumed_train_samples=6, consumed_valid_samples=2)


def config(bf16=False, no_load_optim=False, positions="learned_absolute"):
    cfg = Config(model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                   seq_length=16, max_position_embeddings=16, padded_vocab_size=64,
                                   hidden_dropout=0.0, attention_dropout=0.0,
                                   position_embedding_type=positions),
                 training=TrainingConfig(train_iters=10, micro_batch_size=2, bf16=bf16),
                 optimizer=OptimizerConfig(lr=1e-3))
    cfg.check_layout(1)
    cfg.checkpoint.no_load_optim = no_load_optim
    return cfg


def model(cfg, seed):
    model_parallel_seed(1234, 0)
    m = GPTModel(cfg.model, dtype=torch.bfloat16 if cfg.training.bf16 else torch.float32)
    m.init_weights(seed)
    return m


def logits(m):
    tokens = torch.arange(32).remainder(50).view(2, 16)
    with torch.no_grad():
        return m.eval()(tokens, torch.arange(16).repeat(2, 1)).float()


def stepped_torch_adam(m):
    """The torch optimizer state a Megatron fp32 run saves (bare, as its FP32Optimizer does)."""
    adam = torch.optim.AdamW(_param_groups(m.named_parameters(), 0.01)[0], lr=1e-3)
    for p in m.parameters():
        p.grad = torch.full_like(p, 0.01)
    adam.step()
    for p in m.parameters():
        p.grad = None
    return adam.state_dict()


@pytest.mark.parametrize("version", [1.0, 2.0, 3.0])
@pytest.mark.parametrize("with_optimizer", [True, False])
def test_megatron_files_load_with_equal_logits(tmp_path, version, with_optimizer):
    cfg = config(no_load_optim=not with_optimizer)
    source = model(cfg, seed=7)
    expected = logits(source)
    adam = stepped_torch_adam(model(cfg, seed=7)) if with_optimizer else None
    scheduler = {"max_lr": 1e-3, "min_lr": 0.0, "num_steps": 6, "lr_warmup_steps": 0,
                 "lr_decay_steps": 20, "lr_decay_style": "linear"} if version >= 3.0 else \
        {"max_lr": 1e-3, "min_lr": 0.0, "num_steps": 6, "warmup_steps": 0, "decay_steps": 20,
         "decay_style": "linear", "num_tokens": 0}
    write_megatron_checkpoint(str(tmp_path), to_megatron_layout(source.state_dict()), version,
                              ARGS, iteration=3, optimizer=adam, scheduler=scheduler)
    target = model(cfg, seed=99)
    assert not torch.equal(logits(target), expected)
    optimizer = MegatronOptimizer(cfg.optimizer, [target], single_process_state())
    lr = build_lr_scheduler(optimizer, cfg.optimizer, cfg.training)
    counters = api.load(str(tmp_path), RunState([target], cfg, single_process_state(), optimizer, lr))
    assert counters == (3, 6, 2)  # iteration from the file, consumed samples from args
    torch.testing.assert_close(logits(target), expected, rtol=0, atol=0)
    if with_optimizer:
        assert lr.num_steps == 6
        loaded = optimizer.optimizer.state_dict()["state"]
        for index, saved in adam["state"].items():
            torch.testing.assert_close(loaded[index]["exp_avg"], saved["exp_avg"])


@pytest.mark.parametrize("bf16", [False, True])
def test_our_checkpoint_has_what_megatron_reads_and_resumes_here(tmp_path, bf16):
    cfg = config(bf16=bf16)
    pstate = single_process_state()
    m = model(cfg, seed=3)
    optimizer = MegatronOptimizer(cfg.optimizer, [m], pstate)
    lr = build_lr_scheduler(optimizer, cfg.optimizer, cfg.training)
    with torch.no_grad():  # distinct fp32 main values, to see them come back in order
        for i, main in enumerate(optimizer.main_params):
            main.add_(i * 1e-3)
    api.save(str(tmp_path), 4, RunState([m], cfg, pstate, optimizer, lr, 8, 0))
    path = os.path.join(str(tmp_path), "iter_0000004", "mp_rank_00", "model_optim_rng.pt")
    state = read_megatron_checkpoint(path)
    assert missing_megatron_entries(state) == []
    assert state["args"].consumed_train_samples == 8 and state["iteration"] == 4
    if bf16:  # Megatron's Float16 optimizer reads one list per parameter group
        groups = state["optimizer"]["fp32_from_fp16_params"]
        assert [len(g) for g in groups] == [len(g["params"]) for g in optimizer.param_groups]
    again = model(cfg, seed=5)
    resumed = MegatronOptimizer(cfg.optimizer, [again], pstate)
    assert api.load(str(tmp_path), RunState([again], cfg, pstate, resumed, build_lr_scheduler(
        resumed, cfg.optimizer, cfg.training))) == (4, 8, 0)
    for a, b in zip(optimizer.main_params, resumed.main_params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _trainer_parts(cfg, m, pstate):
    optimizer = MegatronOptimizer(cfg.optimizer, [m], pstate)
    return optimizer, build_lr_scheduler(optimizer, cfg.optimizer, cfg.training)


def test_sinusoidal_positions_round_trip_through_megatron_entries(tmp_path):
    """fairseq's fixed table, which our model recomputes and never saves: our file describes
    it to Megatron as learned absolute positions whose weight is the table. Our loader gets
    the sinusoidal model back; a Megatron reader (the args, no `config`) gets the same logits
    from a learned-positions model."""
    cfg, pstate = config(positions="sinusoidal"), single_process_state()
    source = model(cfg, seed=3)
    expected = logits(source)
    api.save(str(tmp_path / "ours"), 4,
             RunState([source], cfg, pstate, *_trainer_parts(cfg, source, pstate), 8, 0))
    state = read_megatron_checkpoint(
        os.path.join(str(tmp_path / "ours"), "iter_0000004", "mp_rank_00", "model_optim_rng.pt"))
    args = state["args"]
    assert args.position_embedding_type == "learned_absolute" and args.add_position_embedding
    table = state["model"]["language_model"]["embedding"]["position_embeddings"]["weight"]
    torch.testing.assert_close(table, sinusoidal_table(16, 32), rtol=0, atol=0)
    again = model(cfg, seed=5)
    assert not torch.equal(logits(again), expected)
    assert api.load(str(tmp_path / "ours"),
                    RunState([again], cfg, pstate, *_trainer_parts(cfg, again, pstate))) == (4, 8, 0)
    torch.testing.assert_close(logits(again), expected, rtol=0, atol=0)
    write_megatron_checkpoint(str(tmp_path / "megatron"), state["model"], 3.0, vars(args), 4)
    learned = config(no_load_optim=True)
    theirs = model(learned, seed=5)
    api.load(str(tmp_path / "megatron"),
             RunState([theirs], learned, pstate, *_trainer_parts(learned, theirs, pstate)))
    torch.testing.assert_close(logits(theirs), expected, rtol=0, atol=0)


class _Hostile:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_hostile_pickle_in_args_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    path = str(tmp_path / "model_optim_rng.pt")
    torch.save({"args": _Hostile(marker), "checkpoint_version": 3.0, "iteration": 1,
                "model": to_megatron_layout(model(config(), seed=1).state_dict())}, path)
    with pytest.raises(CheckpointError) as err:
        read_model_file(path)
    message = str(err.value)
    assert len(message.splitlines()) == 1 and "system" in message and "not loaded" in message
    assert not marker.exists()
