"""--expert-tensor-parallel-size below TP: the expert grid, its groups and its refusals.

The expert grid re-divides each pipeline stage's TP x CP x DP ranks into ETP (fastest),
EP, then expert-DP, as Megatron-Core's expert RankGenerator (order tp-cp-ep-dp-pp with
tp = ETP) does; the groups are compared with it when megatron-core 0.16.1 is installed.
"""
import pytest

from megatron.mpu.topology import ParallelDims
from tests.gpt_setup import assert_exits_2_with_one_line
from tests import oracles
from tests.mcore_setup import run_mcore_script
from megatron.arguments import parse_args
from tests.unit.test_moe import BASE, parse

LAYOUTS = [(4, 2, 1, 1, 2, 1), (4, 4, 1, 1, 2, 2), (8, 2, 2, 1, 2, 1), (4, 2, 1, 1, 4, 1),
           (8, 2, 1, 2, 2, 1), (16, 4, 2, 1, 2, 2), (2, 2, 1, 1, 1, 1)]
"""(world, TP, PP, CP, EP, ETP)."""


def _dims(world, tp, pp, cp, ep, etp):
    return ParallelDims(world_size=world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)


def test_etp1_ties_the_ep_groups_to_the_tp_groups():
    dims = _dims(4, 2, 1, 1, 2, 1)
    assert dims.tensor_parallel_groups() == [[0, 1], [2, 3]]
    assert dims.expert_parallel_groups() == [[0, 1], [2, 3]]  # each TP group: both EP ranks
    assert dims.expert_data_parallel_groups() == [[0, 2], [1, 3]]
    assert dims.expert_token_groups() == [[0, 1], [2, 3]]  # TP 2 / ETP 1: two token parts
    assert dims.expert_model_parallel_groups() == [[0, 1], [2, 3]]
    # (TP rank, EP rank) of ranks 0..3: (0, 0), (1, 1), (0, 0), (1, 1): two cells written
    assert [dims.first_of_cell(r) for r in range(4)] == [True, True, False, False]


def test_etp_between_one_and_tp_blocks_inside_each_tp_group():
    dims = _dims(4, 4, 1, 1, 2, 2)
    assert dims.expert_tensor_parallel_groups() == [[0, 1], [2, 3]]
    assert dims.expert_parallel_groups() == [[0, 2], [1, 3]]
    assert dims.expert_token_groups() == [[0, 2], [1, 3]]
    assert all(dims.first_of_cell(r) for r in range(4))
    with pytest.raises(ValueError, match=r"expert-tensor-parallel-size \(4\) must divide"):
        ParallelDims(world_size=6, tp=6, etp=4)  # 4 does not divide 6


@oracles.needs("megatron-core")
def test_expert_groups_are_megatron_cores():
    """ETP, EP, expert-DP and ETP x EP x PP groups equal Megatron-Core's RankGenerator's
    (run in a child process: importing megatron.core changes our package's path)."""
    script = f"""
import json
from megatron.core.parallel_state import RankGenerator
out = []
for world, tp, pp, cp, ep, etp in {LAYOUTS!r}:
    edp = world // (pp * ep * etp)
    g = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    out.append([sorted(g.get_ranks(k)) for k in ("tp", "ep", "dp", "tp-ep-pp")])
print(json.dumps(out))
"""
    want = run_mcore_script(script)
    for layout, groups in zip(LAYOUTS, want):
        dims = _dims(*layout)
        got = [sorted(dims.expert_tensor_parallel_groups()), sorted(dims.expert_parallel_groups()),
               sorted(dims.expert_data_parallel_groups()),
               sorted(dims.expert_model_parallel_groups())]
        assert got == groups, layout


def test_expert_tp_flag_defaults_to_tp_and_accepts_divisors():
    cfg = parse("--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
                "--expert-model-parallel-size", "4", world_size=4)
    assert cfg.parallel.expert_tp == 1
    assert parse("--tensor-model-parallel-size", "2", "--disable-bias-linear",
                 world_size=2).parallel.expert_tp == 2


@pytest.mark.parametrize("extra, world, words", [
    (["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "4"], 4,
     ["--expert-tensor-parallel-size (4)", "--tensor-model-parallel-size (2)", "not supported"]),
    (["--tensor-model-parallel-size", "4", "--expert-tensor-parallel-size", "3"], 12,
     ["--expert-tensor-parallel-size (3)", "must divide", "(4)"]),
    (["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "0"], 2,
     ["--expert-tensor-parallel-size must be >= 1", "got 0"]),
    (["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
      "--expert-model-parallel-size", "8"], 4,
     ["--expert-model-parallel-size (8) x --expert-tensor-parallel-size (1)", "world size (4)"]),
])
def test_bad_expert_tp_settings_exit_2_with_one_line(capsys, extra, world, words):
    assert_exits_2_with_one_line(capsys, lambda: parse(*extra, world_size=world), words)


def test_expert_tp_without_experts_exits_2(capsys):
    dense = BASE[:BASE.index("--num-experts")]
    assert_exits_2_with_one_line(capsys, lambda: parse_args(dense + [
        "--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"],
        world_size=2), ["--expert-tensor-parallel-size 1", "needs --num-experts"])
