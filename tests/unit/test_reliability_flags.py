"""Every bad flag value is refused before anything is built: one line, exit 2."""
import subprocess
import sys

import pytest

from megatron.arguments import parse_args
from tests.conftest import ROOT

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--train-iters", "10", "--lr", "1e-3"]

BAD = [
    (["--global-batch-size", "0"], "--global-batch-size"),
    (["--global-batch-size", "-8"], "--global-batch-size"),
    (["--train-iters", "-1"], "--train-iters"),
    (["--adam-beta1", "1.0"], "--adam-beta1"),
    (["--adam-beta1", "-0.1"], "--adam-beta1"),
    (["--adam-beta2", "1.5"], "--adam-beta2"),
    (["--adam-beta2", "-1e-3"], "--adam-beta2"),
    (["--adam-eps", "0"], "--adam-eps"),
    (["--adam-eps", "-1e-8"], "--adam-eps"),
    (["--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by"),
    (["--seed", "-1"], "--seed"),
    (["--split", "a,b,c"], "--split"),
    (["--split", "1,2,3,4"], "--split"),
    (["--split", "-1,2,3"], "--split"),
    (["--split", "0,0,0"], "--split"),
    (["--data-path", "0.5", "A", "0.5"], "--data-path"),
    (["--data-path", "x", "A"], "--data-path"),
    (["--data-path", "nan", "A", "1", "B"], "--data-path"),
    (["--data-path", "inf", "A", "1", "B"], "--data-path"),
    (["--train-weighted-split-paths", "T: nan 0:1 A"], "--train-weighted-split-paths"),
    (["--exit-interval", "0"], "--exit-interval"),
    (["--exit-interval", "-5"], "--exit-interval"),
    (["--lr-decay-iters", "0"], "--lr-decay-iters"),
    (["--loss-scale", "-1"], "--loss-scale"),
    (["--lr", "-1e-3"], "--lr"),
    (["--lr", "abc"], "--lr"),
    (["--min-lr", "-1E-5"], "--min-lr"),
    (["--sgd-momentum", "1"], "--sgd-momentum"),
    (["--initial-loss-scale", "0"], "--initial-loss-scale"),
    (["--hysteresis", "0"], "--hysteresis"),
    (["--lr-warmup-iters", "-1"], "--lr-warmup-iters"),
    (["--layernorm-epsilon", "0"], "--layernorm-epsilon"),
    (["--vocab-size", "0"], "--vocab-size"),
    (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins"),
    (["--max-consecutive-nan-iterations", "-1"], "--max-consecutive-nan-iterations"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes"),
    (["--micro-batch-size", "0"], "--micro-batch-size"),
    (["--num-layers", "-2"], "--num-layers"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--attention-impl", "magic"], "--attention-impl"),
]


@pytest.mark.parametrize("extra, flag", BAD, ids=[" ".join(e) for e, _ in BAD])
def test_bad_flag_value_is_one_line_and_exit_2(capsys, extra, flag):
    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + extra, world_size=1)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert flag in err, err


@pytest.mark.parametrize("value, expected", [("-1e-3", -1e-3), ("-.5", -0.5), ("-1E-3", -1e-3)])
def test_negative_numbers_parse_as_values(value, expected):
    from megatron.arguments import build_parser

    ns = build_parser().parse_args(["--adam-beta1", value])
    assert getattr(ns, "optimizer.adam_beta1") == expected


def test_good_values_still_parse():
    cfg, _ = parse_args(BASE + ["--split", "98/2/0", "--data-path", "0.3", "A", "0.7", "B",
                                "--train-iters", "0", "--seed", "0", "--exit-interval", "5",
                                "--distributed-timeout-minutes", "0.25"], world_size=1)
    assert cfg.training.train_iters == 0 and cfg.parallel.distributed_timeout_minutes == 0.25


@pytest.mark.parametrize("extra", [["--lr", "-1e-3"], ["--split", "1,x"], ["--adam-beta2", "1"]])
def test_pretrain_gpt_refuses_before_building(extra):
    cmd = [sys.executable, str(ROOT / "pretrain_gpt.py")] + BASE + extra + [
        "--tokenizer-type", "ByteLevelTokenizer"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert extra[0] in proc.stderr
