"""Learning-rate schedule, gradient clipping, batch-size ramp-up, the log line and the grad
scaler."""
import math
import re

import pytest
import torch

from megatron.distributed.grads import clip_coefficient
from megatron.optimizer.grad_scaler import DynamicGradScaler
from megatron.optimizer.lr_scheduler import learning_rate
from megatron.training.logging import format_log_line, format_validation
from megatron.training.microbatches import MicroBatches
from tests import oracles
from tests.mcore_setup import run_mcore_script

LR = dict(max_lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110)


def test_warmup_is_linear_from_zero():
    assert [learning_rate(s, style="linear", **LR) for s in (0, 5, 10)] == [0.0, 0.5, 1.0]


@pytest.mark.parametrize("style, step, expected", [
    ("linear", 60, 0.1 + 0.9 * 0.5), ("cosine", 60, 0.1 + 0.9 * 0.5), ("cosine", 35, 0.1 + 0.45 * (1 + math.cos(math.pi / 4))),
    ("constant", 500, 1.0), ("linear", 110, 0.1), ("linear", 1000, 0.1),
    ("inverse-square-root", 40, math.sqrt(10) / math.sqrt(40)),
])
def test_decay_styles(style, step, expected):
    assert learning_rate(step, style=style, **LR) == pytest.approx(expected)


def test_every_style_ends_at_min_lr_after_the_decay():
    """As Megatron-Core's: past --lr-decay-* steps every decaying style, inverse-square-root
    too, gives --min-lr (only constant keeps --lr)."""
    for style in ("linear", "cosine", "inverse-square-root"):
        assert learning_rate(111, style=style, **LR) == LR["min_lr"]
    assert learning_rate(111, style="constant", **LR) == LR["max_lr"]


MCORE_LR = """
import json, sys
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
class Optimizer:
    param_groups = [{}]
out = []
for case in json.load(sys.stdin):
    scheduler = OptimizerParamScheduler(
        Optimizer(), init_lr=0.0, max_lr=case["max_lr"], min_lr=case["min_lr"],
        lr_warmup_steps=case["warmup_steps"], lr_decay_steps=case["decay_steps"],
        lr_decay_style=case["style"], start_wd=0.1, end_wd=0.1, wd_incr_steps=1,
        wd_incr_style="constant")
    lrs = []
    for step in range(case["steps"]):
        scheduler.num_steps = step
        lrs.append(scheduler.get_lr({}))
    out.append(lrs)
print(json.dumps(out))
"""


@oracles.needs("megatron-core")
def test_learning_rate_equals_megatron_cores_scheduler():
    """Every style, with and without warm-up, at every step to well past the decay: the
    learning rate of Megatron-Core 0.16.1's OptimizerParamScheduler (init_lr 0)."""
    cases = [dict(LR, style=style, warmup_steps=warmup, steps=160)
             for style in ("constant", "linear", "cosine", "inverse-square-root")
             for warmup in (0, 10)]
    theirs = run_mcore_script(MCORE_LR, cases)
    for case, want in zip(cases, theirs):
        kwargs = {k: case[k] for k in ("max_lr", "min_lr", "warmup_steps", "decay_steps", "style")}
        got = [learning_rate(step, **kwargs) for step in range(case["steps"])]
        assert got == pytest.approx(want, rel=1e-12, abs=0.0), case


def test_clipping_scales_whenever_megatron_cores_factor_is_below_one():
    """max_norm / (norm + 1e-6) when below 1, as clip_grad_by_total_norm_fp32: a norm equal
    to --clip-grad is scaled by it too; --clip-grad 0 never clips."""
    assert clip_coefficient(2.0, 1.0) == 1.0 / (2.0 + 1e-6)
    assert clip_coefficient(1.0, 1.0) == 1.0 / (1.0 + 1e-6)
    assert clip_coefficient(1.0 - 2e-6, 1.0) is None
    assert clip_coefficient(5.0, 0.0) is None


def test_rampup_grows_global_batch():
    mb = MicroBatches(global_batch_size=32, micro_batch_size=2, dp_size=2, rampup=[8, 8, 300])
    sizes = []
    for consumed in (0, 99, 100, 199, 200, 300, 10_000):
        mb.update(consumed)
        sizes.append((mb.global_batch_size, mb.num_micro_batches))
    assert sizes == [(8, 2), (8, 2), (16, 4), (16, 4), (24, 6), (32, 8), (32, 8)]


def test_log_line_has_megatron_shape():
    line = format_log_line(10, 100, 80, 512.34, 1.5e-4, 8, {"lm loss": 7.123456}, 1.0, 1.234, 0, 0)
    assert line == (" iteration       10/     100 | consumed samples:           80 |"
                    " elapsed time per iteration (ms): 512.3 | learning rate: 1.500E-04 |"
                    " global batch size:     8 | lm loss: 7.123456E+00 | loss scale: 1.0 |"
                    " grad norm: 1.234 | number of skipped iterations:   0 |"
                    " number of nan iterations:   0 |")
    # what common Megatron log parsers extract
    assert re.search(r"iteration\s+(\d+)/\s*(\d+)", line).groups() == ("10", "100")
    assert float(re.search(r"lm loss: ([0-9.E+-]+)", line).group(1)) == pytest.approx(7.123456)


def test_validation_line_reports_ppl():
    line = format_validation("iteration 20", {"lm loss": 2.0})
    assert "lm loss value: 2.000000E+00" in line and f"lm loss PPL: {math.exp(2.0):.6E}" in line


def test_dynamic_scaler_backoff_hysteresis_and_growth():
    s = DynamicGradScaler(2.0 ** 16, min_scale=1.0, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale.item() == 2.0 ** 16  # hysteresis: first overflow tolerated
    s.update(True)
    assert s.scale.item() == 2.0 ** 15
    for _ in range(3):
        s.update(False)
    assert s.scale.item() == 2.0 ** 16
    state = s.state_dict()
    t = DynamicGradScaler(1.0, 1.0, 3, 2)
    t.load_state_dict(state)
    assert torch.equal(t.scale, s.scale)
