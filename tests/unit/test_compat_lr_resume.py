"""On resume the lr schedule follows Megatron (issue 11, deliverable 2): the checkpoint's
settings must match the flags unless --override-... or --use-checkpoint-... says which wins."""
import pytest
import torch

import pretrain_gpt
from megatron.config import ConfigError
from megatron.optimizer.lr_scheduler import LRScheduler
from tests.gpt_setup import one_thread

MOCK = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "97", "--eval-iters", "0", "--num-workers", "0",
        "--log-interval", "1"]


def scheduler(**kwargs):
    values = dict(max_lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=100, style="cosine")
    values.update(kwargs)
    return LRScheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), **values)


def test_scheduler_settings_must_match_unless_told():
    saved = scheduler(decay_steps=80)
    saved.step(40)
    state = saved.state_dict()
    with pytest.raises(ConfigError, match="decay steps 80 but the flags give 100"):
        scheduler().load_state_dict(state)
    flags = scheduler(override=True)
    flags.load_state_dict(state)
    assert (flags.decay_steps, flags.num_steps) == (100, 40)
    ckpt = scheduler(use_checkpoint=True, style="linear")
    ckpt.load_state_dict(state)
    assert (ckpt.decay_steps, ckpt.style, ckpt.get_lr()) == (80, "cosine", saved.get_lr())
    same = scheduler(decay_steps=80)
    same.load_state_dict(state)
    assert same.get_lr() == saved.get_lr()
    # Megatron-LM's and Megatron-DeepSpeed's own key names load too
    megatron_lm = {"max_lr": 1.0, "min_lr": 0.1, "lr_warmup_steps": 10, "lr_decay_steps": 100,
                   "lr_decay_style": "cosine", "num_steps": 7}
    deepspeed = {"max_lr": 1.0, "min_lr": 0.1, "warmup_steps": 10, "decay_steps": 100,
                 "decay_style": "cosine", "num_steps": 7, "num_tokens": 0}
    for state in (megatron_lm, deepspeed):
        resumed = scheduler()
        resumed.load_state_dict(state)
        assert resumed.num_steps == 7


def test_resume_with_other_schedule_flags(tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    with one_thread():
        pretrain_gpt.main(MOCK + ["--train-iters", "2", "--save", save])
        with pytest.raises(SystemExit) as exit_info:
            pretrain_gpt.main(MOCK + ["--train-iters", "4", "--load", save])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(err) == 1
        assert "decay steps 4 but the flags give 8" in err[0]
        for flag in ("--override-lr-scheduler", "--use-checkpoint-opt_param-scheduler"):
            state = pretrain_gpt.main(MOCK + ["--train-iters", "4", "--load", save, flag])
            assert [h["iteration"] for h in state.history] == [3, 4]
