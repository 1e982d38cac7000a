"""DeepSpeed launch lines without DeepSpeed (issue 11, deliverable 3).

Single-process: the ds_config.json keys fill our flags, contradictions name both
sides, ZeRO stages 0-3. One spawn of 2 gloo ranks: a ZeRO-1 DeepSpeed-style run
reproduces the losses of the same run spelled with our own flags.
"""
import json
import os

import pytest

import pretrain_gpt
from megatron.arguments import parse_args
from tests.distributed.run_ranks import run_ranks
from tests.gpt_setup import losses, one_thread, preprocess_wiki, tiny_gpt_argv

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--train-iters", "4",
         "--lr", "1e-3"]
DS_CONFIG = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 8,
             "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
             "zero_optimization": {"stage": 1}, "fp16": {"enabled": False},
             "steps_per_print": 2000, "wall_clock_breakdown": False}


def write_config(tmp_path, **changes):
    values = json.loads(json.dumps(DS_CONFIG))
    values.update(changes)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(values))
    return str(path)


def parse(*argv, world_size=2):
    return parse_args(MODEL + list(argv), parser=pretrain_gpt.build_pretrain_parser(),
                      world_size=world_size)[0]


def test_json_keys_fill_our_flags(tmp_path):
    path = write_config(tmp_path, fp16={"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                                        "loss_scale_window": 500, "hysteresis": 3,
                                        "min_loss_scale": 2})
    c = parse("--deepspeed", "--deepspeed_config", path, "--zero-stage", "1", "--local_rank=0",
              "--deepspeed-activation-checkpointing", "--partition-activations")
    t, o = c.training, c.optimizer
    assert (t.micro_batch_size, t.global_batch_size, o.clip_grad) == (2, 8, 0.5)
    assert c.parallel.use_distributed_optimizer and t.fp16 and o.loss_scale is None
    assert (o.initial_loss_scale, o.loss_scale_window, o.hysteresis, o.min_loss_scale) == \
        (2.0 ** 12, 500, 3, 2.0)
    c = parse("--deepspeed", "--deepspeed_config",
              write_config(tmp_path, bf16={"enabled": True}, train_batch_size=None,
                           zero_optimization={"stage": 0}))
    assert c.training.bf16 and not c.parallel.use_distributed_optimizer
    assert c.training.global_batch_size == 8  # 2 micro x 2 accumulation steps x DP 2
    # without --deepspeed the JSON is ignored, as in Megatron-DeepSpeed
    assert parse("--deepspeed_config", path).training.micro_batch_size == 1


def test_contradictions_and_zero_stages_are_one_line(tmp_path, capsys):
    path = write_config(tmp_path)
    for argv, words in (
            (["--micro-batch-size", "4"], ["train_micro_batch_size_per_gpu=2", "--micro-batch-size 4"]),
            (["--fp16"], ["fp16.enabled=false", "--fp16"]),
            (["--zero-stage", "2"], ["zero_optimization.stage=1", "--zero-stage 2"]),
            (["--global-batch-size", "16"], ["train_batch_size=8", "--global-batch-size 16"])):
        with pytest.raises(SystemExit):
            parse("--deepspeed", "--deepspeed_config", path, *argv)
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and all(w in err for w in words), err
    parse("--deepspeed", "--deepspeed_config", path, "--micro-batch-size", "2")  # agreeing is fine
    with pytest.raises(SystemExit):
        parse("--deepspeed", "--deepspeed_config",
              write_config(tmp_path, zero_optimization={"stage": 3}))
    assert "ZeRO stage 3" in capsys.readouterr().err
    c = parse("--deepspeed", "--deepspeed_config",
              write_config(tmp_path, zero_optimization={"stage": 2}))
    assert c.parallel.use_distributed_optimizer
    notes = [x for x in capsys.readouterr().out.splitlines() if "ZeRO stage 2" in x]
    assert len(notes) == 1
    with pytest.raises(SystemExit):
        parse("--deepspeed", "--deepspeed_config", str(tmp_path / "missing.json"))


def _worker(rank, world_size, tmp, prefix):
    cache = os.path.join(tmp, "cache")
    ours = tiny_gpt_argv(prefix, cache, "--eval-iters", "0", "--use-distributed-optimizer",
                         "--clip-grad", "0.5", "--checkpoint-activations", layers=2, iters=6)
    deepspeed = tiny_gpt_argv(prefix, cache, "--eval-iters", "0", "--deepspeed",
                              "--deepspeed_config", os.path.join(tmp, "ds_config.json"),
                              "--zero-stage", "1", "--deepspeed-activation-checkpointing",
                              "--partition-activations", "--checkpoint-activations",
                              f"--local_rank={rank}", layers=2, iters=6)
    with one_thread():
        return losses(pretrain_gpt.main(ours)), losses(pretrain_gpt.main(deepspeed))


def test_zero1_deepspeed_run_at_dp2_matches_our_flags(tmp_path):
    (tmp_path / "corpus").mkdir()
    prefix = preprocess_wiki(tmp_path / "corpus", docs=4)
    write_config(tmp_path)
    ours, deepspeed = run_ranks(_worker, 2, str(tmp_path), prefix, timeout=280)[-1]
    assert len(ours) == 6 and deepspeed == ours
