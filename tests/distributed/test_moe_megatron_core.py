"""Our MoE layer equals Megatron-Core 0.16.1's MoELayer given the same weights and tokens.

Cases: softmax and sigmoid routing, top-2 of 8 experts, load-balancing loss and z-loss
on, without and with a shared expert (with Qwen-MoE's sigmoid gate), SwiGLU experts;
at EP 1 (one process) and EP 2 (two ranks, each with its own tokens; ours with both
dispatchers). Compared: the layer output, the router probabilities and routing map,
and the load-balancing loss and z-loss (as both record them, without coefficients).
Megatron-Core runs in a subprocess (tests/mcore_reference.py, tests/mcore_moe_layer.py).
"""
import pytest
import torch

from tests import mcore_reference
from tests.distributed.run_ranks import run_ranks

pytestmark = pytest.mark.skipif(not mcore_reference.available(),
                                reason="megatron-core is not installed")

E, H, FFN, SHARED, SEQ, BATCH = 8, 32, 16, 24, 8, 2
CASES = [dict(score="softmax", shared=False), dict(score="sigmoid", shared=False),
         dict(score="softmax", shared=True), dict(score="sigmoid", shared=True)]
TOL = 1e-5


def _weights(case, seed):
    g = torch.Generator().manual_seed(seed)
    w = {"router.weight": torch.randn(E, H, generator=g) * 0.2}
    for e in range(E):
        w[f"experts.local_experts.{e}.linear_fc1.weight"] = torch.randn(2 * FFN, H, generator=g) * 0.2
        w[f"experts.local_experts.{e}.linear_fc2.weight"] = torch.randn(H, FFN, generator=g) * 0.2
    if case["shared"]:
        w["shared_experts.linear_fc1.weight"] = torch.randn(2 * SHARED, H, generator=g) * 0.2
        w["shared_experts.linear_fc2.weight"] = torch.randn(H, SHARED, generator=g) * 0.2
        w["shared_experts.gate_weight"] = torch.randn(1, H, generator=g) * 0.2
    return w


def _tokens(seed, ranks):
    g = torch.Generator().manual_seed(1000 + seed)
    return [torch.randn(SEQ, BATCH, H, generator=g) for _ in range(ranks)]


def _mcore_config(case):
    cfg = dict(num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E,
               moe_router_topk=2, moe_ffn_hidden_size=FFN, ffn_hidden_size=FFN,
               moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
               moe_router_load_balancing_type="aux_loss", moe_token_dispatcher_type="allgather",
               moe_router_score_function=case["score"])
    if case["shared"]:
        cfg.update(moe_shared_expert_intermediate_size=SHARED, moe_shared_expert_gate=True)
    return cfg


def _mcore(ep):
    cases = [{"config": _mcore_config(c), "weights": _weights(c, i), "x": _tokens(i, ep)}
             for i, c in enumerate(CASES)]
    return [r["cases"] for r in mcore_reference.run("mcore_moe_layer.py",
                                                     {"ep": ep, "cases": cases}, world_size=ep)]


def ours(case, weights, x, groups, dispatcher="allgather"):
    """Our MoELayer with Megatron-Core's weights: output, probs, map, losses."""
    from megatron.config import ModelConfig, MoEConfig
    from megatron.model.moe.layer import MoELayer
    moe = MoEConfig(num_experts=E, moe_router_topk=2, moe_ffn_hidden_size=FFN,
                    moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
                    moe_router_score_function=case["score"], moe_token_dispatcher_type=dispatcher,
                    moe_shared_expert_intermediate_size=SHARED if case["shared"] else None,
                    moe_shared_expert_gate=case["shared"])
    cfg = ModelConfig(num_layers=1, hidden_size=H, num_attention_heads=4, seq_length=SEQ,
                      max_position_embeddings=SEQ, ffn_hidden_size=FFN, activation="swiglu",
                      add_bias_linear=False, padded_vocab_size=16, moe=moe)
    layer = MoELayer(cfg, 1, groups, None, torch.float32)
    local = E // groups.ep_size
    first = groups.ep_rank * local
    state = {"router.weight": weights["router.weight"]}
    for fc in ("linear_fc1", "linear_fc2"):
        state[f"experts.{fc}.weight"] = torch.stack(
            [weights[f"experts.local_experts.{e}.{fc}.weight"] for e in range(first, first + local)])
    for name in ("linear_fc1.weight", "linear_fc2.weight", "gate_weight"):
        if case["shared"]:
            state[f"shared_experts.{name}"] = weights[f"shared_experts.{name}"]
    layer.load_state_dict(state, strict=True)
    seen = {}
    layer.router.register_forward_hook(lambda m, i, o: seen.update(probs=o[0], map=o[1]))
    layer.train()
    output, _ = layer(x)
    metrics = layer.router.metrics
    return {"output": output.detach(), "probs": seen["probs"].detach(), "map": seen["map"],
            "load_balancing_loss": float(metrics["load_balancing_loss"]),
            "z_loss": float(metrics["z_loss"])}


def _compare(got, want, what):
    got = {k: torch.as_tensor(v) if not isinstance(v, float) else v for k, v in got.items()}
    assert torch.equal(got["map"], want["map"]), f"{what}: routing maps differ"
    for key in ("output", "probs"):
        diff = (got[key] - want[key]).abs().max().item()
        scale = want[key].abs().max().item()
        assert diff <= TOL * scale, f"{what}: {key} differs by {diff:.3g} (max {scale:.3g})"
    for key in ("load_balancing_loss", "z_loss"):
        assert abs(got[key] - want[key]) <= TOL * abs(want[key]), \
            f"{what}: {key} {got[key]} != {want[key]}"


def test_moe_layer_equals_megatron_core_ep1():
    from megatron.mpu.parallel_state import ExpertGroups
    reference = _mcore(1)[0]
    for i, case in enumerate(CASES):
        got = ours(case, _weights(case, i), _tokens(i, 1)[0], ExpertGroups())
        _compare(got, reference[i], f"EP 1 {case}")


def _rank(rank, world_size):
    import torch.distributed as dist
    from megatron.mpu.parallel_state import ExpertGroups
    groups = ExpertGroups(ep_group=dist.group.WORLD, ep_rank=rank, ep_size=world_size)
    # numpy across the process boundary (tensors would travel as shared-memory handles)
    return {d: [{k: v.numpy() if torch.is_tensor(v) else v for k, v in
                 ours(case, _weights(case, i), _tokens(i, world_size)[rank], groups, d).items()}
                for i, case in enumerate(CASES)] for d in ("allgather", "alltoall")}


def test_moe_layer_equals_megatron_core_ep2():
    reference = _mcore(2)
    results = run_ranks(_rank, 2)
    for rank in range(2):
        for dispatcher, got in results[rank].items():
            for i, case in enumerate(CASES):
                _compare(got[i], reference[rank][i], f"EP 2 rank {rank} {dispatcher} {case}")
