"""Real launch commands that must go through parsing unchanged (issue 22, deliverable 6)."""
import json

import pretrain_gpt
from megatron.arguments import parse_args

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--train-iters", "4",
         "--lr", "1e-3", "--micro-batch-size", "1", "--global-batch-size", "2"]


def parse(*argv, world_size=2):
    return parse_args(MODEL + list(argv), parser=pretrain_gpt.build_pretrain_parser(),
                      world_size=world_size)[0]


def test_run_bf16_disabled_fp16_block_is_ignored(tmp_path, capsys):
    """Megatron-DeepSpeed's run_bf16.sh: its ds_config.json keeps a disabled fp16 block with
    loss_scale 0 next to --loss-scale 12 on the command line; DeepSpeed ignores the block."""
    config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 2,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": 1},
              "fp16": {"enabled": False, "loss_scale": 0, "loss_scale_window": 500,
                       "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 12},
              "bf16": {"enabled": True}, "steps_per_print": 2000, "wall_clock_breakdown": False}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    c = parse("--bf16", "--loss-scale", "12", "--deepspeed", "--deepspeed_config", str(path),
              "--zero-stage", "1", "--deepspeed-activation-checkpointing")
    assert c.training.bf16 and not c.training.fp16
    assert c.optimizer.loss_scale == 12.0 and c.optimizer.loss_scale_window == 1000
    assert c.parallel.use_distributed_optimizer
    out = capsys.readouterr()
    assert "ZeRO stage 1 runs as --use-distributed-optimizer" in out.out + out.err
    # an enabled block still counts: its loss_scale 0 (dynamic) contradicts --loss-scale 12
    config["fp16"]["enabled"], config["bf16"]["enabled"] = True, False
    path.write_text(json.dumps(config))
    try:
        parse("--fp16", "--loss-scale", "12", "--deepspeed", "--deepspeed_config", str(path))
    except SystemExit as err:
        assert err.code == 2
    else:
        raise AssertionError("the contradiction was accepted")
    assert "fp16.loss_scale=0 contradicts --loss-scale 12" in capsys.readouterr().err
