"""Mixture of experts in one process: flags and their errors, the expert-parallel rank
math, routing rules (capacity drops, groups, Sinkhorn, expert bias), the losses, and
the grouped GEMM against the per-expert loop."""
import math

import pytest
import torch

from megatron.arguments import parse_args
from megatron.config import ConfigError, ModelConfig, MoEConfig
from megatron.config.moe import parse_layer_freq
from megatron.model.moe import router as R
from megatron.model.moe.layer import MoELayer
from megatron.mpu.parallel_state import ExpertGroups
from megatron.mpu.topology import ParallelDims
from tests.gpt_setup import assert_exits_2_with_one_line
from tests import oracles
from tests.mcore_setup import run_mcore_script

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--train-iters", "10",
        "--lr", "1e-3", "--num-experts", "8"]


def parse(*extra, world_size=1):
    return parse_args(BASE + list(extra), world_size=world_size)[0]


def test_moe_flags_and_megatron_defaults():
    cfg = parse("--moe-layer-freq", "([0]*1+[1]*1)*2", "--expert-model-parallel-size", "2",
                "--moe-token-dispatcher-type", "alltoall", world_size=2)
    moe = cfg.model.moe
    assert not hasattr(cfg, "moe") and moe.moe_router_topk == 2 and moe.moe_aux_loss_coeff == 0.0
    assert moe.moe_router_load_balancing_type == "aux_loss" and moe.moe_z_loss_coeff is None
    assert moe.moe_expert_capacity_factor is None and moe.moe_router_score_function == "softmax"
    assert [cfg.model.is_moe_layer(n) for n in range(1, 5)] == [False, True, False, True]
    assert cfg.parallel.expert_tensor_parallel_size is None  # = TP
    assert parse().model.moe.layer_pattern(4) == [1, 1, 1, 1]  # --moe-layer-freq 1


def test_layer_freq_forms():
    assert parse_layer_freq("2") == 2
    assert parse_layer_freq("([0]*1+[1]*3)*8") == ([0] + [1] * 3) * 8
    assert MoEConfig(num_experts=4, moe_layer_freq=3).layer_pattern(6) == [1, 0, 0, 1, 0, 0]
    with pytest.raises(ConfigError, match="--moe-layer-freq"):
        parse_layer_freq("__import__('os')")
    with pytest.raises(ConfigError, match="one per layer"):
        MoEConfig(num_experts=4, moe_layer_freq=[1, 0]).layer_pattern(4)


@pytest.mark.parametrize("extra, world, words", [
    (["--moe-router-topk", "9"], 1, ["--moe-router-topk (9)", "--num-experts (8)"]),
    (["--expert-model-parallel-size", "3"], 3, ["--num-experts (8)", "(3)"]),
    (["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"], 6,
     ["--expert-model-parallel-size (2)", "world size (6)"]),
    (["--moe-expert-capacity-factor", "0"], 1, ["--moe-expert-capacity-factor", "got 0.0"]),
    (["--moe-router-score-function", "relu"], 1, ["--moe-router-score-function", "'relu'"]),
    (["--moe-token-dispatcher-type", "flex"], 1, ["--moe-token-dispatcher-type", "'flex'"]),
    (["--moe-router-load-balancing-type", "magic"], 1, ["--moe-router-load-balancing-type"]),
    (["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"], 1,
     ["--moe-router-num-groups (3)"]),
])
def test_bad_moe_settings_exit_2_with_one_line(capsys, extra, world, words):
    assert_exits_2_with_one_line(capsys, lambda: parse(*extra, world_size=world), words)


def test_mixed_layers_are_accepted_in_torch_dist():
    """Dense and MoE layers mixed (keyed per layer in torch_dist, as Megatron-Core does)."""
    cfg = parse("--moe-layer-freq", "2", "--ckpt-format", "torch_dist")
    assert cfg.checkpoint.ckpt_format == "torch_dist" and cfg.model.moe.moe_layer_freq == 2


def test_expert_groups_are_carved_out_of_data_parallelism():
    dims = ParallelDims(world_size=8, tp=2, pp=1, ep=2)
    assert dims.data_parallel_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dims.expert_parallel_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.expert_data_parallel_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.expert_tensor_parallel_groups() == dims.tensor_parallel_groups()
    dims = ParallelDims(world_size=8, tp=1, pp=2, ep=2)
    assert dims.expert_parallel_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.expert_data_parallel_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    for rank in range(8):  # every rank is in exactly one group of each kind
        for groups in (dims.expert_parallel_groups(), dims.expert_data_parallel_groups()):
            assert sum(rank in g for g in groups) == 1
    with pytest.raises(ValueError, match="expert-model-parallel-size"):
        ParallelDims(world_size=4, tp=2, ep=4)


def test_capacity_rule_keeps_highest_probabilities_or_first_positions():
    """capacity = ceil(tokens x topk / experts x factor); per expert the `capacity`
    highest-probability tokens (probs) or the first routed ones (position) stay."""
    probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.7, 0.3], [0.2, 0.8]])
    routing_map = probs > 0.5  # top-1
    assert R.capacity(4, 1, 2, 1.0) == 2
    kept, kept_map = R.drop_over_capacity(probs * routing_map, routing_map, 1, 1.0, "probs", False)
    assert kept_map.tolist() == [[True, False], [False, False], [True, False], [False, True]]
    assert torch.equal(kept, probs * kept_map)
    _, kept_map = R.drop_over_capacity(probs * routing_map, routing_map, 1, 1.0, "position", False)
    assert kept_map.tolist() == [[True, False], [True, False], [False, False], [False, True]]
    # padding: every expert takes exactly `capacity` tokens, the added ones with weight 0
    kept, kept_map = R.drop_over_capacity(probs * routing_map, routing_map, 1, 1.0, "probs", True)
    assert kept_map.sum(0).tolist() == [2, 2] and kept[1].tolist() == [0.0, 0.0]


def test_group_limited_routing_picks_from_the_best_groups():
    scores = torch.tensor([[0.1, 0.2, 0.9, 0.8, 0.3, 0.05, 0.5, 0.4]])
    _, index = R.group_limited_topk(scores, topk=2, num_groups=4, group_topk=1)
    assert sorted(index[0].tolist()) == [2, 3]  # group 1 has the best top-2 sum
    _, index = R.group_limited_topk(scores, topk=2, num_groups=4, group_topk=2)
    assert sorted(index[0].tolist()) == [2, 3]


def test_score_functions():
    logits = torch.randn(5, 8)
    moe = MoEConfig(num_experts=8, moe_router_topk=2)
    probs, routing_map = R.topk_route(logits, moe)
    assert torch.allclose(probs.sum(1), torch.ones(5)) and routing_map.sum(1).tolist() == [2] * 5
    top = logits.topk(2).values
    assert torch.allclose(probs[routing_map].view(5, 2).sort(1).values,
                          torch.softmax(top, -1).sort(1).values)
    moe = MoEConfig(num_experts=8, moe_router_topk=2, moe_router_score_function="sigmoid",
                    moe_router_topk_scaling_factor=2.5)
    probs, _ = R.topk_route(logits, moe)
    assert torch.allclose(probs.sum(1), torch.full((5,), 2.5))
    bias = torch.zeros(8)
    bias[0] = 10.0  # the bias selects expert 0 but does not change its weight
    probs, routing_map = R.topk_route(logits, moe, bias)
    assert routing_map[:, 0].all()


def test_sinkhorn_balances_the_selection():
    torch.manual_seed(0)
    logits = torch.randn(64, 4) + torch.tensor([3.0, 0.0, 0.0, 0.0])  # expert 0 favoured
    plain = logits.topk(1).indices.flatten().bincount(minlength=4)
    _, routing_map = R.sinkhorn_route(logits, 1, training=True)
    balanced = routing_map.sum(0)
    assert plain.max() > 40 and balanced.max() < plain.max()
    cost = R.sinkhorn(logits)
    assert torch.allclose(cost.sum(0), torch.full((4,), 1 / 4), atol=1e-3)


def test_losses_follow_their_formulas():
    torch.manual_seed(0)
    logits = torch.randn(12, 4)
    routing_map, scores = R.aux_loss_scores(logits, 2, "softmax")
    loss = R.switch_aux_loss(scores, routing_map.sum(0), 12, 2, 4, 1.0)
    f = routing_map.float().sum(0) / (12 * 2)
    p = scores.mean(0)
    assert torch.allclose(loss, 4 * (f * p).sum())
    assert torch.allclose(R.z_loss(logits, 0.5), 0.5 * torch.logsumexp(logits, -1).square().mean())


def _layer(add_bias=False, **moe_flags):
    moe = MoEConfig(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, **moe_flags)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=6,
                      max_position_embeddings=6, activation="swiglu", add_bias_linear=add_bias,
                      padded_vocab_size=16, moe=moe)
    torch.manual_seed(0)
    layer = MoELayer(cfg, 1, ExpertGroups(), None, torch.float32)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def _run(layer, x):
    x = x.clone().requires_grad_()
    out, _ = layer(x)
    (out.square().sum()).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    return out.detach(), x.grad, grads


def _close(ours, reference, what=""):
    """Equal to float32 rounding: within 2e-6 of the reference's largest magnitude (the
    grouped paths and the loop each err by ~3e-7 of it against float64; a swapped gate
    or a missing expert errs by O(1))."""
    torch.testing.assert_close(ours, reference, rtol=0,
                               atol=2e-6 * float(reference.abs().max()), msg=what or None)


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_gemm_equals_the_expert_loop(bias):
    """Without biases --moe-grouped-gemm runs the SwiGLU kernel (csrc/fused/moe_cpu.cpp),
    with them GroupedLinear around the activation; both equal the loop."""
    x = torch.randn(6, 3, 32)
    loop, grouped = _layer(add_bias=bias), _layer(add_bias=bias, moe_grouped_gemm=True)
    grouped.load_state_dict(loop.state_dict())
    (a, ga, wa), (b, gb, wb) = _run(loop, x), _run(grouped, x)
    _close(b, a)
    _close(gb, ga)
    for name in wa:
        _close(wb[name], wa[name], name)


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_gemm_adds_weight_gradients_to_the_gradient_buffer(bias):
    """With a `main_grad` buffer (the data-parallel reducer's), the grouped GEMM adds its
    weight gradients to what the buffer holds and leaves `.grad` None; every other
    gradient, and the output, equal the loop's."""
    x = torch.randn(6, 3, 32)
    loop, grouped = _layer(add_bias=bias), _layer(add_bias=bias, moe_grouped_gemm=True)
    grouped.load_state_dict(loop.state_dict())
    experts = {n: p for n, p in grouped.named_parameters() if n.endswith("weight")
               and n.startswith("experts.")}
    held = {n: torch.randn_like(w) for n, w in experts.items()}
    for name, w in experts.items():
        w.main_grad = held[name].clone()
    (a, ga, wa), (b, gb, _) = _run(loop, x), _run_buffered(grouped, x)
    _close(b, a)
    _close(gb, ga)
    for name, p in grouped.named_parameters():
        if name in experts:
            assert p.grad is None
            _close(p.main_grad - held[name], wa[name], name)
        else:
            _close(p.grad, wa[name], name)


def _run_buffered(layer, x):
    x = x.clone().requires_grad_()
    out, _ = layer(x)
    out.square().sum().backward()
    return out.detach(), x.grad, None


def test_grouped_linear_gradients_and_empty_blocks():
    """Blocks of rows times their expert's weight; an expert with no rows gets no gradient
    (and its buffer is left as it was)."""
    from megatron.model.moe.experts import GroupedLinear
    w = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: GroupedLinear.apply(x, w, [2, 0, 5]), (x, w))
    y = GroupedLinear.apply(x, w, [2, 0, 5])
    assert torch.allclose(y, torch.cat([x[:2] @ w[0].t(), x[2:] @ w[2].t()]))
    w.main_grad = torch.ones_like(w)
    GroupedLinear.apply(x, w, [2, 0, 5]).backward(torch.ones(7, 4, dtype=torch.float64))
    assert w.grad is None and torch.equal(w.main_grad[1], torch.ones(4, 5, dtype=torch.float64))
    assert torch.allclose(w.main_grad[2] - 1, torch.ones(4, 5, dtype=torch.float64) @ x[2:].detach())


def test_aux_losses_train_the_router_but_leave_the_output():
    x = torch.randn(6, 3, 32)
    plain, balanced = _layer(), _layer(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.1)
    balanced.load_state_dict(plain.state_dict())
    (a, _, wa), (b, _, wb) = _run(plain, x), _run(balanced, x)
    assert torch.equal(a, b)
    assert not torch.allclose(wa["router.weight"], wb["router.weight"])
    assert set(balanced.router.metrics) == {"load_balancing_loss", "z_loss", "tokens"}
    assert balanced.router.metrics["tokens"].sum() == 6 * 3 * 2


def test_seq_aux_loss_is_the_mean_over_sequences():
    layer = _layer(moe_aux_loss_coeff=1.0, moe_router_load_balancing_type="seq_aux_loss")
    x = torch.randn(6, 3, 32)
    layer(x)
    logits = layer.router.gating(x.reshape(18, 32)).detach()
    per_seq = []
    for b in range(3):
        rows = logits.view(6, 3, 4)[:, b]
        routing_map, scores = R.aux_loss_scores(rows, 2, "softmax")
        per_seq.append(R.switch_aux_loss(scores, routing_map.sum(0), 6, 2, 4, 1.0))
    assert math.isclose(float(layer.router.metrics["load_balancing_loss"]),
                        float(sum(per_seq) / 3), rel_tol=1e-5)


PLANNED = ["--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
           "--moe-layer-freq", "2", "--moe-ffn-hidden-size", "48",
           "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate"]


@pytest.mark.parametrize("extra, world", [([], 1), (["--expert-model-parallel-size", "2"], 2),
                                          (["--expert-model-parallel-size", "2",
                                            "--pipeline-model-parallel-size", "2"], 4)])
def test_planner_counts_each_stages_moe_parameters(extra, world):
    """tools/estimate.py's planner: expert parameters divided by EP, per stage, exactly."""
    from megatron.model import GPTModel
    from megatron.training.memory import stage_params
    cfg = parse(*PLANNED, *extra, world_size=world)
    cfg.model.padded_vocab_size = 128
    pp, ep = cfg.parallel.pipeline_model_parallel_size, cfg.parallel.expert_model_parallel_size
    for rank in range(pp):
        model = GPTModel(cfg.model, device="meta", pre_process=rank == 0,
                         post_process=rank == pp - 1, layer_offset=rank * 4 // pp,
                         num_layers=4 // pp, expert_groups=ExpertGroups(ep_size=ep))
        assert stage_params(cfg, rank) == sum(p.numel() for p in model.parameters())


def test_flops_count_the_activated_experts_only():
    from megatron.training.flops import model_flops
    dense = parse("--swiglu", "--ffn-hidden-size", "96").model
    dense.moe, dense.padded_vocab_size = None, 128
    moe = parse("--swiglu", "--ffn-hidden-size", "96", "--moe-ffn-hidden-size", "48",
                "--moe-layer-freq", "2").model
    moe.padded_vocab_size = 128
    tokens = 2 * 32
    # top-2 of width 48 activate as much as one MLP of width 96; plus the router (8 x h)
    extra = 2 * 3 * 2 * tokens * 64 * 8  # 2 MoE layers, x3 forward + backward, 2 per mul-add
    assert model_flops(moe, 2) == model_flops(dense, 2) + extra
    many = parse("--swiglu", "--ffn-hidden-size", "96", "--moe-ffn-hidden-size", "48",
                 "--moe-layer-freq", "2", "--num-experts", "64").model
    many.padded_vocab_size = 128
    assert model_flops(many, 2) - model_flops(dense, 2) == 2 * 3 * 2 * tokens * 64 * 64


@pytest.mark.parametrize("naming", ["sequential", "grouped", "legacy"])
def test_megatron_lm_moe_key_names_load(naming):
    """A Megatron-LM file whose MoE layers name each expert's tensors separately
    (Megatron-Core's local_experts.N.linear_fc1 or grouped linear_fc1.weightN, or the
    legacy model's local_experts.N.dense_h_to_4h) loads into our stacked experts."""
    import argparse
    from megatron.checkpointing.model_file import from_megatron_layout, to_megatron_layout
    from megatron.checkpointing.megatron_legacy import to_ours
    from megatron.model import GPTModel
    cfg = parse(*PLANNED).model
    cfg.padded_vocab_size = 128
    model = GPTModel(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p)
    ours = model.state_dict()
    theirs = {}
    for name, tensor in ours.items():
        if ".mlp.experts.linear_fc" not in name:
            theirs[name] = tensor
            continue
        head, fc, kind = name.rsplit(".", 3)[0], name.split(".")[-2], name.split(".")[-1]
        for e, row in enumerate(tensor):
            if naming == "sequential":
                theirs[f"{head}.experts.local_experts.{e}.{fc}.{kind}"] = row
            elif naming == "grouped":
                theirs[f"{head}.experts.{fc}.{kind}{e}"] = row
            else:
                legacy = {"linear_fc1": "dense_h_to_4h", "linear_fc2": "dense_4h_to_h"}[fc]
                theirs[f"{head}.local_experts.{e}.{legacy}.{kind}"] = row
    assert not any(k.endswith(".mlp.experts.linear_fc1.weight") for k in theirs)
    state = {"args": argparse.Namespace(num_attention_heads=4), "checkpoint_version": 3.0,
             "model": to_megatron_layout(theirs)}
    loaded = from_megatron_layout(to_ours(state)["model"])
    model.load_state_dict(loaded, strict=True)
    assert all(torch.equal(loaded[k], ours[k]) for k in ours)


@pytest.mark.parametrize("counts", [[5, 0, 10, 4, 6, 3], [40, 0]])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_swiglu_kernel_against_float64(counts, threads):
    """The SwiGLU experts kernel, rows split over 2 or 3 threads (experts 2 and 0 straddle
    two threads' shares: their weight gradients are summed from two parts) or on one:
    output, input and weight gradients equal a float64 loop's to float32 rounding; weight
    gradients are added into given buffers, an empty expert's untouched; without buffers
    they are returned; a frozen input gets no gradient."""
    from megatron.model.moe.experts import SwiGLUExperts, swiglu_kernel
    if swiglu_kernel(torch.zeros(1)) is None:
        pytest.skip("fused CPU kernels unavailable")
    e, h, f, n = len(counts), 32, 24, sum(counts)
    gen = torch.Generator().manual_seed(0)
    x, w1, w2, dy = (torch.randn(*shape, generator=gen) for shape in
                     ((n, h), (e, 2 * f, h), (e, h, f), (n, h)))

    def reference(x, w1, w2):
        out = []
        for i, rows in enumerate(x.split(counts)):
            gate, up = (rows @ w1[i].t()).chunk(2, -1)
            out.append(torch.nn.functional.silu(gate) * up @ w2[i].t())
        return torch.cat(out)

    ref = [t.double().requires_grad_() for t in (x, w1, w2)]
    reference(*ref).backward(dy.double())
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for buffered in (False, True):
            ours = [t.clone().requires_grad_() for t in (x, w1, w2)]
            if buffered:
                for w in ours[1:]:
                    w.main_grad = torch.ones_like(w)
            y = SwiGLUExperts.apply(*ours, counts)
            _close(y.double(), reference(*ref).detach())
            y.backward(dy)
            _close(ours[0].grad.double(), ref[0].grad)
            for w, r in zip(ours[1:], ref[1:]):
                got = w.main_grad - 1 if buffered else w.grad
                assert (w.grad is None) == buffered
                _close(got.double(), r.grad)
                assert not got[1].any()  # expert 1 has no rows
        frozen = x.clone()
        weights = [t.clone().requires_grad_() for t in (w1, w2)]
        SwiGLUExperts.apply(frozen, *weights, counts).backward(dy)
        assert frozen.grad is None and weights[0].grad is not None
    finally:
        torch.set_num_threads(previous)


def test_megatron_args_carry_the_moe_model_both_ways():
    """The args our checkpoints write for Megatron-LM name the experts (its checkpoint
    converters read num_experts, the moe_* sizes and the expert parallel sizes), and the args
    of a Megatron-LM file give back the MoE model as its stored config (--load's defaults),
    without the training-only settings."""
    from megatron.checkpointing.megatron_legacy import megatron_args, stored_config_from_args
    from megatron.mpu.parallel_state import single_process_state
    cfg = parse("--moe-layer-freq", "([0]*1+[1]*1)*2", "--moe-router-topk", "1",
                "--moe-router-pre-softmax", "--moe-aux-loss-coeff", "0.01",
                "--moe-shared-expert-intermediate-size", "32")
    args = megatron_args(cfg, single_process_state(), 3, 6, 0)
    assert (args.num_experts, args.moe_router_topk, args.moe_layer_freq) == (8, 1, [0, 1, 0, 1])
    assert args.moe_aux_loss_coeff == 0.01 and args.moe_shared_expert_intermediate_size == 32
    assert (args.expert_model_parallel_size, args.expert_tensor_parallel_size) == (1, 1)
    moe = stored_config_from_args(args)["model"]["moe"]
    assert moe["num_experts"] == 8 and moe["moe_layer_freq"] == [0, 1, 0, 1]
    assert moe["moe_shared_expert_intermediate_size"] == 32 and "moe_aux_loss_coeff" not in moe
    assert MoEConfig(**moe).layer_pattern(4) == [0, 1, 0, 1]
    dense = megatron_args(parse_args(BASE[:-2])[0], single_process_state(), 3, 6, 0)
    assert dense.num_experts is None and "moe" not in stored_config_from_args(dense)["model"]


MCORE_FINALIZE = """
import importlib, json, sys, torch
from megatron.core import parallel_state
finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
torch.distributed.all_reduce = lambda *a, **k: None  # one rank: the TP x DP x CP sum is itself
parallel_state.get_tensor_and_data_parallel_group = lambda **k: None
payload = json.load(sys.stdin)

class Router(torch.nn.Module):  # what finalize_model_grads reads of its TopKRouter
    def __init__(self, experts):
        super().__init__()
        self.register_buffer("expert_bias", torch.zeros(experts))
        self.register_buffer("local_tokens_per_expert", torch.zeros(experts), persistent=False)

class Config:
    moe_router_enable_expert_bias = True
    moe_router_bias_update_rate = payload["rate"]
    moe_router_load_balancing_type = "aux_loss"

steps = payload["counts"]  # [step][layer][expert]
model = [torch.nn.Sequential(*[Router(len(steps[0][0])) for _ in steps[0]])]
biases = []
for counts in steps:  # its schedules run finalize_model_grads before the optimizer step
    for router, tokens in zip(model[0], counts):
        router.local_tokens_per_expert += torch.tensor(tokens)  # TopKRouter._apply_expert_bias
    finalize._update_router_expert_bias(model, Config)
    finalize.reset_model_temporary_tensors(Config, model)
    biases.append([router.expert_bias.tolist() for router in model[0]])
print(json.dumps(biases))
"""


def _record_bias_updates(monkeypatch):
    """Per training step, whether the optimizer skipped it; per expert-bias update, the tokens
    each router's forwards routed, and its counts and bias as the update found and left them."""
    from megatron.model.moe.layer import moe_layers
    from megatron.training import trainer
    steps, skipped, routed = [], [], {}
    real_update, real_step, real_forward = (trainer.update_expert_bias,
                                            trainer.Trainer.train_step, R.TopKRouter.forward)

    def update(models, pstate):
        routers = [layer.router for layer in moe_layers(models)]
        found = [(r.local_tokens_per_expert.clone(), r.expert_bias.clone()) for r in routers]
        real_update(models, pstate)
        steps.append(dict(found=found, routed=[routed.pop(id(r)) for r in routers],
                          left=[(r.local_tokens_per_expert.clone(), r.expert_bias.clone())
                                for r in routers]))

    def train_step(self, iterators):
        out = real_step(self, iterators)
        skipped.append(out[2])
        return out

    def forward(self, x, seq_shape):
        probs, routing_map = real_forward(self, x, seq_shape)
        if self.training and torch.is_grad_enabled():
            routed[id(self)] = routed.get(id(self), 0) + routing_map.sum(dim=0).float()
        return probs, routing_map
    monkeypatch.setattr(trainer, "update_expert_bias", update)
    monkeypatch.setattr(trainer.Trainer, "train_step", train_step)
    monkeypatch.setattr(R.TopKRouter, "forward", forward)
    return steps, skipped


def test_expert_bias_moves_every_step_skipped_or_not_as_megatron_cores(monkeypatch):
    """fp16 from a loss scale of 2^24: the first steps overflow and are skipped, the later
    ones apply. Megatron-Core updates the expert bias in finalize_model_grads, before the
    optimizer decides to skip, and then resets the counts; so here every step's bias is
    what its _update_router_expert_bias gives from that step's tokens alone (no carry-over
    from a skipped step), and bias and counts stay float32 in the fp16 model. With
    megatron-core installed its own finalize code gives the whole chain of biases."""
    import pretrain_gpt
    from tests.gpt_setup import one_thread
    from tests.unit.test_launch_compat import TINY
    steps, skipped = _record_bias_updates(monkeypatch)
    with one_thread():
        pretrain_gpt.main(TINY + [
            "--num-layers", "2", "--global-batch-size", "4", "--train-iters", "8",
            "--num-experts", "4", "--moe-router-score-function", "sigmoid",
            "--moe-router-enable-expert-bias", "--fp16", "--initial-loss-scale", str(2 ** 24),
            "--hysteresis", "1"])
    assert True in skipped and False in skipped, skipped
    assert len(steps) == len(skipped) == 8, "one expert-bias update per step"
    for step in steps:
        for (counts, bias), routed, (left, _) in zip(step["found"], step["routed"], step["left"]):
            assert torch.equal(counts, routed) and counts.sum() == 4 * 16 * 2  # tokens x top-2
            assert counts.dtype == bias.dtype == torch.float32 and not left.any()
    for step, after in zip(steps, steps[1:] + [None]):
        for i, (counts, bias) in enumerate(step["found"]):
            moved = R.updated_expert_bias(counts, bias, 1e-3)
            assert torch.equal(step["left"][i][1], moved) and (
                after is None or torch.equal(after["found"][i][1], moved))
    oracles.require("megatron-core")  # ours is checked above; now against theirs
    theirs = run_mcore_script(MCORE_FINALIZE, {"rate": 1e-3, "counts": [
        [counts.tolist() for counts, _ in step["found"]] for step in steps]})
    ours = [[bias.tolist() for _, bias in step["left"]] for step in steps]
    assert ours == theirs
