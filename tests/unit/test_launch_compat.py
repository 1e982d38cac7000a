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


def test_step_batch_size_schedule_word_split_is_the_same_schedule():
    """A launch script that keeps the flag in a bash array and expands it unquoted (as
    Megatron-LM's examples expand their argument arrays) hands the schedule over as words."""
    import subprocess
    script = 'ARGS=(--step-batch-size-schedule "0:2 1K:4, 2K:8" --global-batch-size 8); ' \
             'printf "%s\\n" ${ARGS[@]}'
    words = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                           check=True).stdout.split()
    assert words[:5] == ["--step-batch-size-schedule", "0:2", "1K:4,", "2K:8",
                         "--global-batch-size"]
    quoted = parse("--step-batch-size-schedule", "0:2 1K:4, 2K:8", "--global-batch-size", "8")
    split = parse(*words)
    assert split.training == quoted.training
    assert split.training.step_batch_size_schedule == "0:2 1K:4, 2K:8"


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


def test_megatron_lm_gpt3_175b_launch_parses_and_sets_up(tmp_path, monkeypatch):
    """Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh argument lists, as written,
    on the 16 nodes x 8 GPUs its TP 8 x PP 16 needs."""
    from tests.gpt_setup import bpe_flags
    ckpt = str(tmp_path / "ckpt")
    model = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
             "--seq-length", "2048", "--max-position-embeddings", "2048",
             "--attention-backend", "auto"]
    training = ["--micro-batch-size", "1", "--global-batch-size", "1536", "--rampup-batch-size",
                "16", "16", "5859375", "--train-iters", "500000", "--weight-decay", "0.1",
                "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006",
                "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine",
                "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000"]
    parallel = ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16"]
    data = ["--data-path", "data/prefix", *bpe_flags(), "--split", "949,50,1"]
    logging = ["--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000",
               "--save", ckpt, "--load", ckpt, "--eval-iters", "10",
               "--tensorboard-dir", str(tmp_path / "tb")]
    monkeypatch.setenv("WORLD_SIZE", "128")
    config, tokenizer = pretrain_gpt.setup(model + training + parallel + data + logging)
    t = config.training
    assert (t.global_batch_size, t.rampup_batch_size, t.fp16) == (1536, [16, 16, 5859375], True)
    assert config.parallel.tensor_model_parallel_size == 8 and tokenizer.vocab_size == 8000  # the test BPE files


def test_multilingual_validation_groups_are_evaluated_and_logged_each(tmp_path, capsys):
    """Megatron-DeepSpeed's pretrain_gpt_multilingual.sh data-group form: one weighted train
    group over two "languages", named validation and test groups, each evaluated and logged
    on its own line; the final evaluation prints its progress."""
    from tests.gpt_setup import bpe_flags, one_thread, preprocess_wiki
    en = preprocess_wiki(tmp_path, docs=8)
    fr = en  # a second language: the same corpus, other documents
    argv = MODEL[:-4] + [
        "--micro-batch-size", "1", "--global-batch-size", "2",
        "--train-weighted-split-paths", f"TRAIN: 0.6 0:0.5 {en}, 0.4 0:0.5 {fr}",
        "--valid-weighted-split-paths", f"VALID_EN: 1 0.5:0.75 {en}", f"VALID_FR: 1 0.75:1 {fr}",
        "--test-weighted-split-paths", f"TEST_EN: 1 0.5:1 {en}", f"TEST_FR: 1 0.5:1 {fr}",
        "--data-cache-path", str(tmp_path / "cache"), "--num-workers", "0", "--eval-iters", "1",
        "--eval-interval", "2", "--log-interval", "1", *bpe_flags(),
        "--make-vocab-size-divisible-by", "16"]
    with one_thread():
        state = pretrain_gpt.main(argv)
    out = capsys.readouterr().out
    for name in ("VALID_EN", "VALID_FR"):
        assert f" validation loss at iteration 2 | {name} | lm loss value: " in out
        assert f" validation loss at iteration 4 | {name} | lm loss value: " in out
    for name in ("TEST_EN", "TEST_FR"):
        assert f" validation loss at the end of training for test data | {name} | " in out
    assert out.count(" Evaluating iter 1/1") == 4  # final valid and test, two groups each
    groups = [v["group"] for v in state.validation]
    assert groups == ["VALID_EN", "VALID_FR"] * 2 + ["TEST_EN", "TEST_FR"]
    # the groups of a split advance the validation samples as one group: 2 per evaluation
    assert state.consumed_valid == 3 * 2


def test_deepspeed_example_falls_back_to_torchrun_without_the_launcher(tmp_path):
    """examples/deepspeed_zero1_gpt.sh without `deepspeed` on PATH says in one line how to
    get it and launches the same flags with torchrun."""
    import subprocess
    from tests.conftest import ROOT
    from tests.unit.test_examples import STUB
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(STUB)
    (bin_dir / "torchrun").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "RECORD": str(tmp_path / "argv"),
           "DATA": "data/prefix", "VOCAB": "vocab.json", "MERGE": "merges.txt"}
    done = subprocess.run(["bash", str(ROOT / "examples" / "deepspeed_zero1_gpt.sh")], env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stderr.strip().splitlines() == [
        "deepspeed launcher not found (pip install deepspeed, see README); launching with "
        "torchrun --nproc_per_node 8 instead"]
    args = (tmp_path / "argv").read_text().splitlines()
    assert args[:3] == ["--nproc_per_node", "8", "pretrain_gpt.py"] and "--deepspeed" in args
