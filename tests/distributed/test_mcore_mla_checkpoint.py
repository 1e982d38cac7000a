"""torch_dist checkpoints of a model with multi-latent attention and one MTP layer, both ways
with Megatron-Core 0.16.1 (issue 30, item 4).

Megatron-Core: GPTModel with get_gpt_layer_local_spec(multi_latent_attention=True,
qk_layernorm=True) (the q / kv norms; without qk_layernorm they are identities) and
get_gpt_mtp_block_spec, RMSNorm, SwiGLU, tied embeddings, plain RoPE; with and without
query compression (q_lora_rank None: linear_q_proj). MLA from the local spec runs here with
tests/mcore_setup.patch_mla on top of import_mcore (../shared/references.md): its
DotProductAttention must accept `k_channels` / `v_channels` and size its output by the value
head size, and `multi_latent_attention.HAVE_TE` must be False without Transformer Engine.

One spawn of 2 ranks. At TP 2: Megatron-Core saves (dist_checkpointing.save) and ours loads;
ours saves (--ckpt-format torch_dist, save_model_weights) and a fresh Megatron-Core model
loads. Then at TP 1 (DP 2) the TP 2 saves of both sides load on the other side (re-sharding
2 -> 1 both ways), and TP 1 saves go both ways. Compared: the per-token main losses (with MTP
Megatron-Core's GPTModel needs labels and returns losses, not logits) and the MTP loss
(its MTPLossLoggingHelper tracker vs ours.mtp.losses), max difference under 1e-5 of their
size; a fresh model before loading is checked to differ.

Status (measured): TP 1 -> TP 1 both ways, our TP 2 save -> Megatron-Core TP 1, and
Megatron-Core's TP 2 save -> ours at TP 1 compared with Megatron-Core at TP 1 reading the same
files agree to ~1e-7. Megatron-Core's TP 2 model (MLA + MTP, local spec, CPU) differs by
~0.14 relative from Megatron-Core at TP 1 reading the checkpoint that model saved
(`mcore->mcore 2->1`, with and without query compression), so the cases that compare with
its TP 2 outputs are strict xfails until that is explained.
"""
import os

import pytest
import torch
import torch.nn.functional as F

from tests import oracles
from tests.distributed.run_ranks import run_ranks

pytestmark = oracles.needs("megatron-core")

LAYERS, H, HEADS, FFN, SEQ, BATCH, VOCAB = 2, 32, 4, 64, 8, 2, 64
MLA = dict(kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6)
CASES = {"q-compressed": 20, "no-q-compression": None}
TOL = 1e-5


def _tokens():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.arange(SEQ).expand(BATCH, SEQ), labels, torch.ones(BATCH, SEQ)


def _mcore(tp: int, q_lora_rank, seed: int):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_mtp_block_spec)
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    config = MLATransformerConfig(
        num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        q_lora_rank=q_lora_rank, rope_type="rope", normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32, tensor_model_parallel_size=tp, mtp_num_layers=1,
        mtp_loss_scaling_factor=0.1, **MLA)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True,
                                    normalization="RMSNorm")
    torch.manual_seed(seed)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope", parallel_output=False,
                    share_embeddings_and_output_weights=True,
                    mtp_block_spec=get_gpt_mtp_block_spec(config, spec,
                                                          use_transformer_engine=False))


def _ours(pstate, q_lora_rank, seed: int):
    from megatron.config import ModelConfig
    from megatron.model import GPTModel
    cfg = ModelConfig(num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS,
                      seq_length=SEQ, max_position_embeddings=SEQ, ffn_hidden_size=FFN,
                      position_embedding_type="rope", normalization="RMSNorm",
                      activation="swiglu", add_bias_linear=False, hidden_dropout=0.0,
                      attention_dropout=0.0, padded_vocab_size=VOCAB, mtp_num_layers=1,
                      multi_latent_attention=True, q_lora_rank=q_lora_rank, **MLA)
    model = GPTModel(cfg, tp_group=pstate.tp_group, parallel_output=False)
    model.init_weights(seed)
    return model


def _mcore_outputs(model) -> dict:
    from megatron.core.transformer.multi_token_prediction import (MTPLossAutoScaler,
                                                                  MTPLossLoggingHelper)
    tokens, positions, labels, mask = _tokens()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    MTPLossLoggingHelper.tracker.clear()
    with torch.no_grad():  # with MTP its GPTModel needs labels: per-token losses out
        losses = model.train()(tokens, positions, None, labels=labels, loss_mask=mask)
    return {"losses": losses, "mtp": MTPLossLoggingHelper.tracker["values"].clone()}


def _our_outputs(model) -> dict:
    tokens, positions, labels, mask = _tokens()
    with torch.no_grad():
        losses = model.train()(tokens, positions, labels=labels, loss_mask=mask)
    return {"losses": losses, "mtp": model.mtp.losses[-1].detach().clone()}


def _mcore_save(model, directory: str) -> None:
    from megatron.core import dist_checkpointing
    if torch.distributed.get_rank() == 0:
        os.makedirs(directory)
    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), directory)


def _gap(got: dict, want: dict) -> dict:
    return {k: (got[k] - want[k]).abs().max().item() / want[k].abs().max().item()
            for k in want}


def _tp_phase(workdir: str, tp: int, q_lora_rank, case: str, saved: dict) -> dict:
    """Both ways at this TP, and loads of the other TP's saves (in `saved`)."""
    from megatron.checkpointing import torch_dist
    from megatron.mpu.parallel_state import initialize_model_parallel
    pstate = initialize_model_parallel(tp=tp)
    out = {}
    theirs = _mcore(tp, q_lora_rank, seed=1)
    mcore_dir = os.path.join(workdir, f"{case}-mcore-tp{tp}")
    _mcore_save(theirs, mcore_dir)
    saved[("mcore", tp)] = (mcore_dir, _mcore_outputs(theirs))
    ours = _ours(pstate, q_lora_rank, seed=3)
    ours_dir = os.path.join(workdir, f"{case}-ours-tp{tp}", "iter_0000001")
    torch_dist.save_model_weights(ours_dir, [ours], LAYERS, pstate)
    saved[("ours", tp)] = (ours_dir, _our_outputs(ours))
    for (side, src), (directory, want) in saved.items():
        if side == "mcore":
            model = _ours(pstate, q_lora_rank, seed=5)
            out[f"fresh ours differs {src}->{tp}"] = _gap(_our_outputs(model), want)
            torch_dist.load_model_weights(directory, [model], LAYERS, pstate)
            got = _our_outputs(model)
            out[f"mcore->ours {src}->{tp}"] = _gap(got, want)
            if src != tp:  # Megatron-Core itself reading the same files at this TP
                reader = _mcore(tp, q_lora_rank, seed=6)
                _mcore_load(reader, directory)
                read = _mcore_outputs(reader)
                out[f"mcore->mcore {src}->{tp}"] = _gap(read, want)
                out[f"mcore->ours {src}->{tp} vs mcore reading it"] = _gap(got, read)
        else:
            model = _mcore(tp, q_lora_rank, seed=6)
            out[f"fresh mcore differs {src}->{tp}"] = _gap(_mcore_outputs(model), want)
            _mcore_load(model, directory)
            out[f"ours->mcore {src}->{tp}"] = _gap(_mcore_outputs(model), want)
    return out


def _mcore_load(model, directory: str) -> None:
    from tests.distributed.test_mcore_training_step import mcore_load
    mcore_load(model, directory)


def _rank(rank, world_size, workdir):
    from tests.mcore_setup import import_mcore, patch_mla
    import_mcore()
    patch_mla()
    from megatron.core import parallel_state
    from megatron.model.moe.router import AuxLossScaler
    from megatron.mpu.random import model_parallel_seed
    AuxLossScaler.set_scale(1.0)
    out = {}
    for case, q_lora_rank in CASES.items():
        saved = {}
        for tp in (2, 1):
            model_parallel_seed(1234, rank if tp == 2 else 0)
            for name, gap in _tp_phase(workdir, tp, q_lora_rank, case, saved).items():
                out[f"{case} {name}"] = gap
            parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def spawn2(tmp_path_factory):
    return run_ranks(_rank, 2, str(tmp_path_factory.mktemp("mla-ckpt")), timeout=900)


# Where Megatron-Core runs at TP 2 (it saves, or it loads, at TP 2) its per-token losses and
# MTP loss differ from ours on the same checkpoint by ~0.14 relative; not resolved yet (see
# the module docstring). Strict: these fail loudly once they agree.
_OPEN = "Megatron-Core at TP 2 (MLA + MTP, local spec) disagrees with the checkpoint it saved/loaded"
PAIRS = [("mcore->ours", 1, 1), ("ours->mcore", 1, 1), ("ours->mcore", 2, 1),
         ("mcore->ours", "2", "1 vs mcore reading it"),
         pytest.param("mcore->ours", 2, 1, marks=pytest.mark.xfail(strict=True, reason=_OPEN)),
         pytest.param("mcore->ours", 2, 2, marks=pytest.mark.xfail(strict=True, reason=_OPEN)),
         pytest.param("ours->mcore", 2, 2, marks=pytest.mark.xfail(strict=True, reason=_OPEN))]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("direction,src,dst", PAIRS)
def test_losses_and_mtp_loss_equal_after_loading(case, direction, src, dst, spawn2):
    fresh = "fresh ours" if direction == "mcore->ours" else "fresh mcore"
    for rank, result in enumerate(spawn2):
        gaps = result[f"{case} {direction} {src}->{dst}"]
        assert max(gaps.values()) < TOL, (rank, case, direction, src, dst, gaps)
        assert max(result[f"{case} {fresh} differs {src}->{str(dst)[0]}"].values()) > 1e-3, \
            (rank, "the load did not change the model")
