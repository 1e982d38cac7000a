"""--log-straggler's report (megatron/training/straggler.py) and its timers, in one process."""
import pytest

from megatron.arguments import parse_args
from megatron.mpu.mappings import WaitClock
from megatron.training.logging import Timers
from megatron.training.straggler import StragglerDetector, describe_hosts, format_straggler_line


def test_the_report_names_the_slowest_and_fastest_ranks_with_their_hosts_and_ratio():
    line = format_straggler_line(10, [100.0, 110.0, 400.0, 90.0], ["a", "a", "b", "b"], count=2)
    assert line == (" straggler report at iteration 10 | step compute time (ms) slowest: "
                    "400.0 (rank 2, b), 110.0 (rank 1, a) | fastest: 90.0 (rank 3, b), "
                    "100.0 (rank 0, a) | slowest/fastest: 4.44 |")
    one = format_straggler_line(1, [5.0], ["h"], count=3)
    assert "slowest: 5.0 (rank 0, h) | fastest: 5.0 (rank 0, h) | slowest/fastest: 1.00" in one


def test_ranks_per_host():
    assert describe_hosts(["n1", "n1", "n2", "n2"]) == " > ranks per host: n1: 0 1 | n2: 2 3"


def test_collective_time_inside_the_compute_timers_is_not_compute():
    clock = WaitClock()
    timers = Timers(0, always=("forward-compute",), wait_clock=clock)
    waited = clock.timed(lambda: None)
    timers.start("forward-compute")
    waited()
    clock.seconds += 0.25  # as if the collective had waited 0.25 s
    timers.stop("forward-compute")
    timers.start("optimizer")  # not recorded at level 0
    timers.stop("optimizer")
    elapsed, waits = timers.pop_all(), timers.pop_waits()
    assert set(elapsed) == {"forward-compute"} and waits["forward-compute"] >= 0.25
    detector = StragglerDetector(count=1)
    report = detector.report(4, {"forward-compute": 2.25, "backward-compute": 1.0},
                             {"forward-compute": 0.25}, iterations=4)
    assert "slowest: 750.0 (rank 0," in report


def test_the_flags_parse_and_a_count_below_one_is_refused(capsys):
    flags = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
             "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1",
             "--train-iters", "1", "--lr", "1e-3"]
    config, _ = parse_args(flags + ["--log-straggler", "--straggler-minmax-count", "3"])
    assert config.logging.log_straggler and config.logging.straggler_minmax_count == 3
    with pytest.raises(SystemExit):
        parse_args(flags + ["--straggler-minmax-count", "0"])
    assert "--straggler-minmax-count must be at least 1, got 0" in capsys.readouterr().err
