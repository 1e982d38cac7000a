"""torch_dist checkpoints go both ways between Megatron-Core 0.16.1 and this framework (issue 20).

In one spawn of 2 gloo ranks, at TP 1 and TP 2: a Megatron-Core GPTModel (local spec, 2
layers, hidden 64, 4 heads, tied embeddings, tanh GeLU as our default) is saved with
Megatron-Core's `dist_checkpointing.save`; our GPTModel loads it and gives Megatron-Core's
logits on the same tokens (atol 1e-6). Our model, saved in torch_dist, loads into a freshly
initialised Megatron-Core model with `dist_checkpointing.load` and gives our logits. The same
both ways for an MoE GPT at EP 2 (4 experts with biases, top 2, Megatron-Core's SequentialMLP:
expert tensors `decoder.layers.mlp.experts.experts.*` of shape [layers, experts, ...]), and for
one whose first layer is dense (--moe-layer-freq [0, 1]: every layer keyed on its own,
`decoder.layers.1.mlp.experts.experts.*` of shape [experts, ...]), and for one with an expert
bias (sigmoid scores, aux-loss-free balancing: the router's persistent buffer
`decoder.layers.mlp.router.expert_bias` [layers, experts], given seeded non-zero values so
that a bias left at zero changes the routing and the logits). At TP 1, Megatron-LM's
--ckpt-format torch_dcp both ways: Megatron-Core's GPTModel.state_dict() saved as Megatron-LM's
save does (dcp.save of {"model", "iteration", "checkpoint_version", "args"}) loads into a fresh
model of ours, and ours saved in torch_dcp loads into a fresh Megatron-Core model as
Megatron-LM's load reads it (dcp.load of {"model": state_dict()}, then load_state_dict).
"""
import os

import pytest
import torch
import torch.nn.functional as F

from tests import oracles
from tests.distributed.run_ranks import run_ranks

pytestmark = oracles.needs("megatron-core")

LAYERS, HIDDEN, HEADS, VOCAB, SEQ = 2, 64, 4, 128, 16
EXPERTS, EP = 4, 2


def _mcore_model(tp: int, seed: int):
    from tests.mcore_setup import mcore_gpt
    torch.manual_seed(seed)
    return mcore_gpt(tp, LAYERS, HIDDEN, HEADS, VOCAB, SEQ,
                     activation_func=lambda x: F.gelu(x, approximate="tanh"),
                     share_embeddings_and_output_weights=True, parallel_output=False)


def _our_model(tp: int):
    from megatron.config import ModelConfig
    from megatron.model import GPTModel
    from megatron.mpu.parallel_state import initialize_model_parallel
    pstate = initialize_model_parallel(tp=tp)
    cfg = ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                      seq_length=SEQ, max_position_embeddings=SEQ, padded_vocab_size=VOCAB,
                      hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(cfg, tp_group=pstate.tp_group, parallel_output=False)
    return model.eval(), pstate


def _expert_bias(layer: int) -> torch.Tensor:
    return torch.randn(EXPERTS, generator=torch.Generator().manual_seed(11 + layer)) * 0.05


def _bias_settings(bias: bool) -> dict:
    return dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True) \
        if bias else {}


def _mcore_moe(seed: int, freq=1, bias=False):
    """Megatron-Core's MoE GPT (local spec, SequentialMLP experts with biases) at EP 2; with
    `freq` a list, dense and MoE layers mixed (its block spec: one layer spec each); with
    `bias` an expert bias of sigmoid scores."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                          get_gpt_layer_local_spec)
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.transformer_config import TransformerConfig
    moe_utils.te_general_gemm = None  # references.md item 5
    parallel_state.initialize_model_parallel(expert_model_parallel_size=EP)
    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                            use_cpu_initialization=True, hidden_dropout=0.0,
                            attention_dropout=0.0, params_dtype=torch.float32,
                            activation_func=lambda x: F.gelu(x, approximate="tanh"),
                            num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=32,
                            expert_model_parallel_size=EP, moe_token_dispatcher_type="allgather",
                            moe_layer_freq=freq, **_bias_settings(bias))
    spec = (get_gpt_layer_local_spec(num_experts=EXPERTS) if freq == 1
            else get_gpt_decoder_block_spec(cfg, use_transformer_engine=False))
    return GPTModel(cfg, spec, vocab_size=VOCAB,
                    max_sequence_length=SEQ, share_embeddings_and_output_weights=True,
                    parallel_output=False).eval()


def _our_moe(freq=1, bias=False):
    from megatron.config import ModelConfig, MoEConfig
    from megatron.model import GPTModel
    from megatron.mpu.parallel_state import initialize_model_parallel
    pstate = initialize_model_parallel(ep=EP)
    cfg = ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                      seq_length=SEQ, max_position_embeddings=SEQ, padded_vocab_size=VOCAB,
                      hidden_dropout=0.0, attention_dropout=0.0,
                      moe=MoEConfig(num_experts=EXPERTS, moe_router_topk=2,
                                    moe_ffn_hidden_size=32, moe_layer_freq=freq,
                                    **_bias_settings(bias)))
    model = GPTModel(cfg, tp_group=pstate.tp_group, expert_groups=pstate.expert_groups(),
                     parallel_output=False)
    return model.eval(), pstate


MOE_CASES = {"moe-ep2": (1, False), "mixed-ep2": ([0, 1], False), "bias-ep2": (1, True)}
"""(--moe-layer-freq, expert bias) of each MoE case: every layer MoE (Megatron-Core stacks the
layers along a leading axis), or a dense first layer (it keys each layer on its own,
decoder.layers.<g>.*); an expert bias in every layer."""


def _moe_both_ways(workdir, tokens, positions, case: str) -> dict:
    """An MoE GPT at EP 2: Megatron-Core's checkpoint into ours, ours into Megatron-Core."""
    from megatron.checkpointing import torch_dist
    from megatron.core import dist_checkpointing, parallel_state
    freq, bias = MOE_CASES[case]
    theirs = _mcore_moe(seed=1, freq=freq, bias=bias)
    for i, layer in enumerate(theirs.decoder.layers if bias else []):
        layer.mlp.router.expert_bias.copy_(_expert_bias(i))
    mcore_dir = os.path.join(workdir, f"mcore-{case}")
    if torch.distributed.get_rank() == 0:
        os.makedirs(mcore_dir)
    torch.distributed.barrier()
    dist_checkpointing.save(theirs.sharded_state_dict(), mcore_dir)
    with torch.no_grad():
        their_logits = theirs(tokens, positions, None)
    ours, pstate = _our_moe(freq, bias)
    torch_dist.load_model_weights(mcore_dir, [ours], LAYERS, pstate)
    with torch.no_grad():
        our_logits = ours(tokens, positions)
    out = {f"mcore->ours {case}": (our_logits - their_logits).abs().max().item()}
    if bias:
        out[f"zero bias differs {case}"] = _without_bias(ours, tokens, positions, their_logits)
    ours_dir = os.path.join(workdir, f"ours-{case}", "iter_0000001")
    torch_dist.save_model_weights(ours_dir, [ours], LAYERS, pstate)
    parallel_state.destroy_model_parallel()
    fresh = _mcore_moe(seed=2, freq=freq, bias=bias)
    with torch.no_grad():
        out[f"fresh differs {case}"] = (fresh(tokens, positions, None)
                                        - our_logits).abs().max().item()
    _mcore_load(fresh, ours_dir)
    with torch.no_grad():
        out[f"ours->mcore {case}"] = (fresh(tokens, positions, None) - our_logits).abs().max().item()
    parallel_state.destroy_model_parallel()
    return out


@torch.no_grad()
def _without_bias(ours, tokens, positions, their_logits) -> float:
    """How far our logits are from Megatron-Core's with the loaded expert bias zeroed (what a
    load that dropped it gave: the bias matters to this test)."""
    routers = [layer.mlp.router for layer in ours.language_model.encoder.layers]
    kept = [router.expert_bias.clone() for router in routers]
    for router in routers:
        router.expert_bias.zero_()
    far = (ours(tokens, positions) - their_logits).abs().max().item()
    for router, bias in zip(routers, kept):
        router.expert_bias.copy_(bias)
    return far


def _tokens():
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    return tokens, torch.arange(SEQ).expand(2, SEQ)


def _mcore_load(model, directory):
    from megatron.core import dist_checkpointing
    wanted = {k: v for k, v in model.sharded_state_dict().items()
              if not k.endswith("_extra_state")}  # None for the local spec; not written here
    model.load_state_dict(dist_checkpointing.load(wanted, directory), strict=False)


def _dcp_both_ways(workdir, theirs, their_logits, tokens, positions) -> dict:
    """Megatron-LM's --ckpt-format torch_dcp (at TP 1, all it allows): its save, dcp.save of
    {"model": GPTModel.state_dict(), "iteration", "checkpoint_version", "args"}, read by a
    fresh model of ours; ours (torch_dcp) read as its load reads it, dcp.load of
    {"model": state_dict()} then load_state_dict, by a fresh Megatron-Core model."""
    import argparse
    import torch.distributed.checkpoint as dcp
    from megatron.checkpointing import api, torch_dcp, torch_dist
    theirs_dir = os.path.join(workdir, "mcore-dcp", "iter_0000001")
    ours_dir = os.path.join(workdir, "ours-dcp", "iter_0000001")
    if torch.distributed.get_rank() == 0:
        os.makedirs(theirs_dir)
    torch.distributed.barrier()
    dcp.save({"model": theirs.state_dict(), "iteration": 1, "checkpoint_version": 3.0,
              "args": argparse.Namespace(num_layers=LAYERS)}, checkpoint_id=theirs_dir)
    ours, pstate = _our_model(1)
    out = {"detected dcp": [api.detect_directory(d).name for d in (theirs_dir,)]}
    torch_dist.load_model_weights(theirs_dir, [ours], LAYERS, pstate, fmt=torch_dcp.FORMAT)
    with torch.no_grad():
        our_logits = ours(tokens, positions)
    out["mcore->ours dcp"] = (our_logits - their_logits).abs().max().item()
    torch_dist.save_model_weights(ours_dir, [ours], LAYERS, pstate, fmt=torch_dcp.FORMAT)
    out["detected dcp"].append(api.detect_directory(ours_dir).name)
    fresh = _mcore_model(1, seed=2).eval()
    with torch.no_grad():
        out["fresh differs dcp"] = (fresh(tokens, positions, None) - our_logits).abs().max().item()
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=ours_dir)
    fresh.load_state_dict(state["model"])
    with torch.no_grad():
        out["ours->mcore dcp"] = (fresh(tokens, positions, None) - our_logits).abs().max().item()
    return out


def _rank(rank, world_size, workdir):
    from tests.mcore_setup import import_mcore
    import_mcore()
    from megatron.checkpointing import torch_dist
    from megatron.core import dist_checkpointing, parallel_state
    tokens, positions = _tokens()
    out = {}
    for tp in (1, 2):
        theirs = _mcore_model(tp, seed=1).eval()
        mcore_dir = os.path.join(workdir, f"mcore-tp{tp}")
        if rank == 0:
            os.makedirs(mcore_dir)
        torch.distributed.barrier()
        dist_checkpointing.save(theirs.sharded_state_dict(), mcore_dir)
        with torch.no_grad():
            their_logits = theirs(tokens, positions, None)
        ours, pstate = _our_model(tp)
        torch_dist.load_model_weights(mcore_dir, [ours], LAYERS, pstate)
        with torch.no_grad():
            our_logits = ours(tokens, positions)
        out[f"mcore->ours tp{tp}"] = (our_logits - their_logits).abs().max().item()
        if tp == 1:
            out.update(_dcp_both_ways(workdir, theirs, their_logits, tokens, positions))
        ours_dir = os.path.join(workdir, f"ours-tp{tp}", "iter_0000001")
        torch_dist.save_model_weights(ours_dir, [ours], LAYERS, pstate)
        fresh = _mcore_model(tp, seed=2).eval()
        _mcore_load(fresh, ours_dir)
        with torch.no_grad():
            out[f"ours->mcore tp{tp}"] = (fresh(tokens, positions, None) - our_logits).abs().max().item()
            out[f"fresh differs tp{tp}"] = (_mcore_model(tp, 2)(tokens, positions, None)
                                             - our_logits).abs().max().item()
        parallel_state.destroy_model_parallel()
    for case in MOE_CASES:
        out.update(_moe_both_ways(workdir, tokens, positions, case))
    return out


@pytest.fixture(scope="module")
def spawn2(tmp_path_factory):
    return run_ranks(_rank, 2, str(tmp_path_factory.mktemp("mcore")), timeout=600)


def test_torch_dcp_directories_are_detected(spawn2):
    assert [r["detected dcp"] for r in spawn2] == [["torch_dcp", "torch_dcp"]] * 2


@pytest.mark.parametrize("case", ["tp1", "tp2", "dcp", *MOE_CASES])
@pytest.mark.parametrize("direction", ["mcore->ours", "ours->mcore"])
def test_logits_equal_after_loading(direction, case, spawn2):
    for rank, result in enumerate(spawn2):
        assert result[f"{direction} {case}"] < 1e-6, (rank, result)
        assert result[f"fresh differs {case}"] > 1e-3  # the load did change the model
        if MOE_CASES.get(case, (1, False))[1]:  # and the expert bias changes the routing
            assert result[f"zero bias differs {case}"] > 1e-3, (rank, result)
