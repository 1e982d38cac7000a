"""The MoE settings Megatron-Core's TransformerConfig (and its MoE code) refuses are refused
here too, each in one line naming the flags, with exit status 2 (issue 33, item 3).

Each case pairs our flags with the TransformerConfig fields they mean; with megatron-core
0.16.1 installed, one child process checks that Megatron-Core refuses every such setting
and accepts every accepted neighbour below, so the list follows its rules, not our reading
of them. (MLA and MTP have no flags here yet, and TransformerConfig's CP checks concern
settings our flags cannot express: a per-layer --cp-comm-type list, gated delta net, DSA.)
"""
import pytest

from megatron.arguments import parse_args
from tests.gpt_setup import assert_exits_2_with_one_line
from tests import oracles
from tests.mcore_setup import run_mcore_script
from tests.unit.test_moe import BASE

DENSE = BASE[:BASE.index("--num-experts")]
MCORE_BASE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_moe_experts=8,
                  moe_router_topk=2)
"""BASE's model in TransformerConfig's terms (its defaults: linear biases, softmax top-k,
aux_loss balancing, as ours)."""

REFUSED = {
    "expert bias with softmax": (
        ["--moe-router-enable-expert-bias"], 1,
        ["--moe-router-enable-expert-bias", "--moe-router-score-function sigmoid", "got softmax"],
        dict(moe_router_enable_expert_bias=True)),
    "top-1 softmax after top-k": (
        ["--moe-router-topk", "1"], 1,
        ["--moe-router-topk 1", "--moe-router-score-function softmax", "--moe-router-pre-softmax"],
        dict(moe_router_topk=1)),
    "capacity factor with sinkhorn": (
        ["--moe-router-load-balancing-type", "sinkhorn", "--moe-expert-capacity-factor", "1.0"],
        1, ["--moe-expert-capacity-factor", "--moe-router-load-balancing-type", "sinkhorn"],
        dict(moe_router_load_balancing_type="sinkhorn", moe_expert_capacity_factor=1.0)),
    "aux loss with sinkhorn": (
        ["--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0.01"], 1,
        ["--moe-router-load-balancing-type sinkhorn", "--moe-aux-loss-coeff"],
        None),  # Megatron-Core asserts it in TopKRouter.sinkhorn_load_balancing, at run time
    "expert width without experts": (
        DENSE + ["--moe-ffn-hidden-size", "32"], 1,
        ["--moe-ffn-hidden-size needs --num-experts"],
        dict(num_moe_experts=None, moe_ffn_hidden_size=32, moe_router_topk=2)),
    "group top-k without groups": (
        ["--moe-router-group-topk", "1"], 1,
        ["--moe-router-group-topk needs --moe-router-num-groups"],
        dict(moe_router_group_topk=1)),
    "more groups picked than exist": (
        ["--moe-router-topk", "4", "--moe-router-num-groups", "2", "--moe-router-group-topk",
         "4"], 1, ["--moe-router-group-topk (4)", "[1, 2]"],
        dict(moe_router_topk=4, moe_router_num_groups=2, moe_router_group_topk=4)),
    "groups that do not divide the experts": (
        ["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"], 1,
        ["--moe-router-num-groups (3)", "--num-experts (8)"],
        dict(moe_router_num_groups=3, moe_router_group_topk=1)),
    "padding to a capacity that is not set": (
        ["--moe-pad-expert-input-to-capacity"], 1,
        ["--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"],
        dict(moe_pad_expert_input_to_capacity=True)),
    "no experts": (["--num-experts", "0"], 1, ["--num-experts must be positive", "got 0"],
                   dict(num_moe_experts=0)),
    "a shared expert of width 0": (
        ["--moe-shared-expert-intermediate-size", "0"], 1,
        ["--moe-shared-expert-intermediate-size must be positive"],
        dict(moe_shared_expert_intermediate_size=0)),
    "expert parallelism without experts": (
        DENSE + ["--expert-model-parallel-size", "2"], 2,
        ["--expert-model-parallel-size 2", "needs --num-experts"],
        dict(num_moe_experts=None, expert_model_parallel_size=2, moe_router_topk=2)),
}
"""name -> (flags after BASE, or DENSE + flags; world size; words of the one line;
TransformerConfig fields, None where Megatron-Core refuses it outside TransformerConfig)."""

ACCEPTED = {
    "top-1 softmax over all experts": (["--moe-router-topk", "1", "--moe-router-pre-softmax"],
                                       1, dict(moe_router_topk=1, moe_router_pre_softmax=True)),
    "top-1 sigmoid": (["--moe-router-topk", "1", "--moe-router-score-function", "sigmoid"], 1,
                      dict(moe_router_topk=1, moe_router_score_function="sigmoid")),
    "top-1 sinkhorn": (["--moe-router-topk", "1", "--moe-router-load-balancing-type",
                        "sinkhorn"], 1,
                       dict(moe_router_topk=1, moe_router_load_balancing_type="sinkhorn")),
    "expert bias with sigmoid": (["--moe-router-enable-expert-bias",
                                  "--moe-router-score-function", "sigmoid"], 1,
                                 dict(moe_router_enable_expert_bias=True,
                                      moe_router_score_function="sigmoid")),
    "capacity factor with aux_loss": (["--moe-expert-capacity-factor", "1.0"], 1,
                                      dict(moe_expert_capacity_factor=1.0)),
    "expert biases at expert TP 1": (["--tensor-model-parallel-size", "2",
                                      "--expert-tensor-parallel-size", "1",
                                      "--sequence-parallel"], 2,
                                     dict(tensor_model_parallel_size=2,
                                          expert_tensor_parallel_size=1,
                                          sequence_parallel=True)),
    "no biases at expert TP 2": (["--tensor-model-parallel-size", "2", "--disable-bias-linear",
                                  "--sequence-parallel"], 2,
                                 dict(tensor_model_parallel_size=2, add_bias_linear=False,
                                      sequence_parallel=True)),
}
"""name -> (flags after BASE, world size, TransformerConfig fields): the neighbours of the
refusals, which both accept."""


def _argv(flags):
    """A case's flags follow BASE (an MoE model) unless they start with DENSE's."""
    return flags if flags[:len(DENSE)] == DENSE else BASE + flags


@pytest.mark.parametrize("flags, world, words, _", REFUSED.values(), ids=list(REFUSED))
def test_what_megatron_core_refuses_exits_2_with_one_line(capsys, flags, world, words, _):
    assert_exits_2_with_one_line(capsys, lambda: parse_args(_argv(flags), world_size=world),
                                 words)


@pytest.mark.parametrize("flags, world, _", ACCEPTED.values(), ids=list(ACCEPTED))
def test_the_neighbours_are_accepted(flags, world, _):
    assert parse_args(_argv(flags), world_size=world)[0].model.moe.enabled


MCORE_CHECKS = """
import json, sys, warnings
warnings.simplefilter("ignore")
from megatron.core.transformer.transformer_config import TransformerConfig
out = []
for fields in json.load(sys.stdin):
    try:
        TransformerConfig(**fields)
        out.append(None)
    except (ValueError, AssertionError) as err:
        out.append(str(err) or type(err).__name__)
print(json.dumps(out))
"""


@oracles.needs("megatron-core")
def test_megatron_core_refuses_the_same_settings():
    checked = {name: case[-1] for name, case in REFUSED.items() if case[-1] is not None}
    cases = [dict(MCORE_BASE, **fields) for fields in checked.values()]
    cases += [dict(MCORE_BASE, **fields) for *_, fields in ACCEPTED.values()] + [MCORE_BASE]
    verdicts = run_mcore_script(MCORE_CHECKS, cases)
    refused, accepted = verdicts[:len(checked)], verdicts[len(checked):]
    assert all(refused), dict(zip(checked, refused))
    assert not any(accepted), dict(zip([*ACCEPTED, "base"], accepted))
