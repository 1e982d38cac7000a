"""Our MoE layer equals Megatron-Core 0.16.1's MoELayer given the same weights and tokens.

Cases: softmax and sigmoid routing, top-2 of 8 experts, load-balancing loss and z-loss
on, without and with a shared expert (with Qwen-MoE's sigmoid gate), SwiGLU experts;
at EP 1 (one process) and EP 2 (two ranks, each with its own tokens; ours with both
dispatchers). Compared: the layer output, the router probabilities and routing map,
and the load-balancing loss and z-loss (as both record them, without coefficients).
Both run in the same spawned ranks (Megatron-Core through tests/mcore_setup.py).
"""
import pytest
import torch

from tests import oracles
from tests.distributed.run_ranks import run_ranks

pytestmark = oracles.needs("megatron-core")

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


def theirs(case, weights, x, ep, rank):
    """Megatron-Core's MoELayer (its parallel state initialised at EP `ep`) with the same
    weights (this rank's experts): output, probs, map, and the losses it recorded."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_utils import (clear_aux_losses_tracker,
                                                         get_moe_layer_wise_logging_tracker)
    from megatron.core.transformer.transformer_config import TransformerConfig
    clear_aux_losses_tracker()
    config = TransformerConfig(**_mcore_config(case), activation_func=F.silu,
                               gated_linear_unit=True, add_bias_linear=False,
                               use_cpu_initialization=True, expert_model_parallel_size=ep,
                               hidden_dropout=0.0, attention_dropout=0.0, bf16=False,
                               params_dtype=torch.float32)
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    layer = MoELayer(config, spec.submodules.mlp.submodules, layer_number=1)
    layer.set_layer_number(1)
    local = E // ep
    state = {}
    for name in layer.state_dict():
        if name.endswith("_extra_state"):
            continue
        parts = name.split(".")
        if parts[:2] == ["experts", "local_experts"]:
            parts[2] = str(rank * local + int(parts[2]))
        state[name] = weights[".".join(parts)]
    layer.load_state_dict(state, strict=False)
    seen = {}
    layer.router.register_forward_hook(lambda m, i, o: seen.update(probs=o[0], map=o[1]))
    layer.train()
    output, _ = layer(x)
    losses = {name: float(v["values"][0])
              for name, v in get_moe_layer_wise_logging_tracker().items()}
    return {"output": output.detach(), "probs": seen["probs"].detach(), "map": seen["map"],
            **losses}


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


def _rank(rank, world_size):
    """Theirs and ours (both dispatchers) at EP = world size, on this rank's tokens."""
    import torch.distributed as dist
    from megatron.mpu.parallel_state import ExpertGroups
    from tests.mcore_setup import import_mcore
    import_mcore()
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size)
    groups = ExpertGroups(ep_group=dist.group.WORLD, ep_rank=rank, ep_size=world_size)
    inputs = [(case, _weights(case, i), _tokens(i, world_size)[rank])
              for i, case in enumerate(CASES)]
    results = {"mcore": [theirs(*args, world_size, rank) for args in inputs]}
    for dispatcher in ("allgather", "alltoall"):
        results[dispatcher] = [ours(*args, groups, dispatcher) for args in inputs]
    return results


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_layer_equals_megatron_core(ep):
    for rank, results in enumerate(run_ranks(_rank, ep)):
        reference = results.pop("mcore")
        for dispatcher, got in results.items():
            for i, case in enumerate(CASES):
                _compare(got[i], reference[i], f"EP {ep} rank {rank} {dispatcher} {case}")
