"""Flag parsing and configuration rules."""
import subprocess
import sys

import pytest

from megatron.arguments import parse_args
from megatron.config import Config, ConfigError, ModelConfig
from tests.conftest import ROOT
from tests.gpt_setup import assert_exits_2_with_one_line

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--train-iters", "10", "--lr", "1e-3"]


def parse(*extra, world_size=1):
    return parse_args(BASE + list(extra), world_size=world_size)[0]


def test_megatron_flags_fill_the_config():
    cfg = parse("--micro-batch-size", "2", "--global-batch-size", "16", "--lr-decay-style", "cosine",
                "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                "--DDP-impl", "local", "--no-masked-softmax-fusion", world_size=8)
    assert cfg.model.num_layers == 4 and cfg.model.ffn_hidden_size == 256
    assert cfg.training.global_batch_size == 16 and cfg.optimizer.lr_decay_style == "cosine"
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.model.masked_softmax_fusion is False
    assert cfg.optimizer.weight_decay == 0.01 and cfg.model.make_vocab_size_divisible_by == 128


def test_global_batch_defaults_to_micro_batch_times_dp():
    assert parse("--micro-batch-size", "3", world_size=4).training.global_batch_size == 12


@pytest.mark.parametrize("extra, world, words", [
    (["--num-attention-heads", "3"], 1, ["--hidden-size (64)", "--num-attention-heads (3)"]),
    (["--tensor-model-parallel-size", "8"], 8, ["--num-attention-heads (4)", "(8)"]),
    (["--pipeline-model-parallel-size", "3"], 3, ["--num-layers (4)", "(3)"]),
    (["--global-batch-size", "10", "--micro-batch-size", "4"], 1, ["(10)", "(4)"]),
    (["--global-batch-size", "6", "--micro-batch-size", "2"], 2, ["(6)", "data-parallel size (2)"]),
    (["--seq-length", "64"], 1, ["--seq-length (64)", "--max-position-embeddings (32)"]),
    (["--train-samples", "100"], 1, ["--train-iters (10)", "--train-samples (100)"]),
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 6,
     ["(2)", "world size (6)"]),
    (["--fp16", "--bf16"], 1, ["--fp16", "--bf16"]),
    (["--lr", "1e-3", "--min-lr", "1e-2"], 1, ["--min-lr (0.01)"]),
    (["--ddp-bucket-size", "0"], 1, ["--ddp-bucket-size", "got 0"]),
])
def test_inconsistent_flags_exit_2_with_one_line(capsys, extra, world, words):
    assert_exits_2_with_one_line(capsys, lambda: parse(*extra, world_size=world), words)


def test_config_round_trips_through_a_dict():
    cfg = parse("--micro-batch-size", "2")
    assert Config.from_dict(cfg.to_dict()) == cfg


def test_model_config_rejects_bad_dropout():
    with pytest.raises(ConfigError, match="--hidden-dropout"):
        ModelConfig(hidden_dropout=1.5)


def test_cli_error_has_no_traceback():
    """An invalid combination prints one line and exits 2 before anything starts."""
    cmd = [sys.executable, str(ROOT / "pretrain_gpt.py")] + BASE + [
        "--num-attention-heads", "5", "--tokenizer-type", "ByteLevelTokenizer"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "--num-attention-heads (5)" in proc.stderr


def test_missing_model_flag_is_reported(tmp_path):
    cmd = [sys.executable, str(ROOT / "pretrain_gpt.py"), "--train-iters", "1", "--lr", "1e-3",
           "--tokenizer-type", "ByteLevelTokenizer"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "--num-layers" in proc.stderr
