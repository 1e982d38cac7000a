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


def test_step_batch_size_schedule_matches_a_hand_computed_table():
    """100 tokens per sample, "0:2 1K:4 2K:8": 2 until 1000 tokens are consumed (exactly at
    the boundary it is 4), 4 until 2000, then 8. The batch is a function of the consumed
    samples, so a run resumed at any step gets the same one."""
    from megatron.config.batch_schedule import parse_step_schedule
    from megatron.training.microbatches import MicroBatches
    from megatron.training.trainer import total_iterations
    assert parse_step_schedule("0:16 2.4B:320, 1e12:640") == \
        [(0, 16), (2_400_000_000, 320), (10 ** 12, 640)]
    mb = MicroBatches(8, 1, 2, step_schedule=parse_step_schedule("0:2 1K:4 2K:8"),
                      seq_length=100)
    table = [(0, 2), (2, 2), (4, 2), (6, 2), (8, 2), (10, 4), (14, 4), (18, 4), (22, 8), (30, 8)]
    consumed = 0
    for expected_consumed, batch in table:
        assert consumed == expected_consumed
        mb.update(consumed)
        assert (mb.global_batch_size, mb.num_micro_batches) == (batch, batch // 2)
        consumed += mb.global_batch_size
    resumed = MicroBatches(8, 1, 2, step_schedule=parse_step_schedule("0:2 1K:4 2K:8"),
                           seq_length=100)
    resumed.update(14)
    assert resumed.global_batch_size == 4
    c = parse("--step-batch-size-schedule", "0:2 1K:4 2K:8", "--global-batch-size", "8")
    c.model.seq_length = 100
    c.training.train_iters, c.training.train_samples = None, 38
    assert total_iterations(c) == 10  # 2 x 5 + 4 x 3 + 8 x 2 = 38 samples


def test_step_batch_size_schedule_errors_are_one_line(capsys):
    for flags, words in ((["0:2 x:4"], "'x:4' is not TOKENS:BATCH"),
                         (["16:2"], "start at 0"),
                         (["0:3"], "batch 3 must be divisible")):
        try:
            parse("--step-batch-size-schedule", *flags, "--global-batch-size", "8")
        except SystemExit as err:
            assert err.code == 2
        else:
            raise AssertionError(flags)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err


TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "63", "--micro-batch-size", "1",
        "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--use-cpu-initialization"]


def test_fp16_on_cpu_warns_once(capsys):
    from tests.gpt_setup import one_thread
    with one_thread():
        pretrain_gpt.main(TINY + ["--train-iters", "1", "--fp16"])
    out = capsys.readouterr().out
    assert out.count("WARNING: --fp16 on a CPU") == 1 and "use --bf16 or fp32" in out


def test_step_batch_size_schedule_trains_and_resumes_exactly(tmp_path, capsys):
    """Mock data, 16 tokens per sample, "0:2 64:4": batches 2, 2, 4, 4; stopping after step 2
    and resuming gives the same batches and losses as the uninterrupted run."""
    from tests.gpt_setup import losses, one_thread
    tiny = TINY + ["--step-batch-size-schedule", "0:2 64:4"]
    with one_thread():
        whole = losses(pretrain_gpt.main(tiny + ["--train-iters", "4"]))
        sizes = [line.split("global batch size:")[1].split("|")[0].strip()
                 for line in capsys.readouterr().out.splitlines() if "global batch size:" in line]
        assert sizes == ["2", "2", "4", "4"]
        save = str(tmp_path / "ckpt")
        pretrain_gpt.main(tiny + ["--train-iters", "4", "--save", save, "--exit-interval", "2"])
        rest = losses(pretrain_gpt.main(tiny + ["--train-iters", "4", "--load", save]))
    assert rest == whole[2:]
