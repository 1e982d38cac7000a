"""Our multi-token prediction equals Megatron-Core 0.16.1's (issue 30, item 2).

A GPT model (RoPE, RMSNorm, SwiGLU, tied embeddings, 1 decoder layer) with 2 MTP depths:
ours, and Megatron-Core's GPTModel with `get_gpt_mtp_block_spec(config,
get_gpt_layer_local_spec())` loading our weights from our torch_dist save (so its keys,
`mtp.layers.N...`, are Megatron-Core's). The MTP norms get random weights. Same tokens and a
loss mask with holes; both models backward the masked mean loss with the MTP loss scale 1.
Compared within 1e-5 relative: the per-token main losses, each depth's output and loss
(Megatron-Core's MTPLossLoggingHelper tracker), the gradient of the MTP block's input (the
decoder output), and the gradients of eh_proj and the word embeddings; at TP 1, TP 2 and
TP 2 with sequence parallelism (ranks in one spawn per TP size).
"""
import os

import pytest
import torch

from tests import oracles
from tests.distributed.run_ranks import run_ranks

pytestmark = oracles.needs("megatron-core")

H, HEADS, FFN, SEQ, BATCH, VOCAB, DEPTHS = 32, 4, 64, 8, 2, 64, 2
TOL = 1e-5
CASES = {1: [False], 2: [False, True]}  # TP size: sequence parallel or not


def _tokens():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ)
    mask[0, 2], mask[1, 5], mask[1, 7] = 0, 0, 0
    return tokens, torch.arange(SEQ).expand(BATCH, SEQ), labels, mask


def _ours(pstate, sp: bool):
    from megatron.config import ModelConfig
    from megatron.model import GPTModel
    cfg = ModelConfig(num_layers=1, hidden_size=H, num_attention_heads=HEADS, seq_length=SEQ,
                      max_position_embeddings=SEQ, ffn_hidden_size=FFN,
                      position_embedding_type="rope", normalization="RMSNorm",
                      activation="swiglu", add_bias_linear=False, hidden_dropout=0.0,
                      attention_dropout=0.0, use_cpu_initialization=True,
                      padded_vocab_size=VOCAB, mtp_num_layers=DEPTHS, sequence_parallel=sp)
    model = GPTModel(cfg, tp_group=pstate.tp_group)
    model.init_weights(11)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.mtp.named_parameters():
            if name.endswith(("norm.weight",)):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return model


def _theirs(tp: int, sp: bool, directory: str):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_mtp_block_spec)
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tests.distributed.test_mcore_training_step import mcore_load
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32,
        tensor_model_parallel_size=tp, sequence_parallel=sp, mtp_num_layers=DEPTHS,
        mtp_loss_scaling_factor=0.1)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope", mtp_block_spec=mtp,
                     share_embeddings_and_output_weights=True)
    mcore_load(model, directory)
    return model


def _run(model, block, layers, call, embedding) -> dict:
    """Forward and backward of the masked mean loss; what is compared."""
    seen = {"outputs": []}

    def keep_input(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        hidden.retain_grad()
        seen["input"] = hidden
    block.register_forward_pre_hook(keep_input, with_kwargs=True)
    for layer in layers:
        layer.register_forward_hook(
            lambda m, i, out: seen["outputs"].append((out[0] if isinstance(out, tuple)
                                                      else out).detach().clone()))
    model.train()
    tokens, positions, labels, mask = _tokens()
    losses = call(tokens, positions, labels, mask)
    ((losses.float() * mask).sum() / mask.sum()).backward()
    return {"losses": losses.detach(), "outputs": seen["outputs"], "input_grad": seen["input"].grad,
            "eh_proj": [layer.eh_proj.weight.grad for layer in layers],
            "embedding": embedding.weight.grad}


def _rank(rank, world_size, workdir):
    from tests.mcore_setup import import_mcore
    import_mcore()
    from megatron.checkpointing import torch_dist
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import (MTPLossAutoScaler,
                                                                  MTPLossLoggingHelper)
    from megatron.model.moe.router import AuxLossScaler
    from megatron.mpu.parallel_state import initialize_model_parallel
    from megatron.mpu.random import model_parallel_seed
    pstate = initialize_model_parallel(tp=world_size)
    model_parallel_seed(1234, pstate.tp_rank)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    results = {}
    for sp in CASES[world_size]:
        directory = os.path.join(workdir, f"sp{int(sp)}", "iter_0000001")
        ours = _ours(pstate, sp)
        torch_dist.save_model_weights(directory, [ours], 1, pstate)
        AuxLossScaler.set_scale(1.0)
        mine = _run(ours, ours.mtp, list(ours.mtp.layers),
                    lambda t, p, y, m: ours(t, p, labels=y, loss_mask=m),
                    ours.language_model.embedding.word_embeddings)
        mine["mtp"] = ours.mtp.losses[-1]
        theirs = _theirs(world_size, sp, directory)
        MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        MTPLossLoggingHelper.tracker.clear()
        found = _run(theirs, theirs.mtp, list(theirs.mtp.layers),
                     lambda t, p, y, m: theirs(t, p, None, labels=y, loss_mask=m),
                     theirs.embedding.word_embeddings)
        found["mtp"] = MTPLossLoggingHelper.tracker["values"].clone()
        results[sp] = (mine, found)
    parallel_state.destroy_model_parallel()
    return results


def _close(got, want, what):
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    diff, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert diff <= TOL * scale, f"{what}: differs by {diff:.3g} (max {scale:.3g})"


@pytest.mark.parametrize("tp", list(CASES))
def test_mtp_equals_megatron_core(tp, tmp_path):
    for rank, results in enumerate(run_ranks(_rank, tp, str(tmp_path))):
        for sp, (mine, found) in results.items():
            what = f"TP {tp} SP {sp} rank {rank}"
            for key in ("losses", "mtp", "input_grad", "embedding"):
                _close(mine[key], found[key], f"{what} {key}")
            assert len(mine["outputs"]) == len(found["outputs"]) == DEPTHS
            for k in range(DEPTHS):
                _close(mine["outputs"][k], found["outputs"][k], f"{what} depth {k + 1} output")
                _close(mine["eh_proj"][k], found["eh_proj"][k],
                       f"{what} depth {k + 1} eh_proj grad")
            assert float(mine["mtp"].min()) > 1.0  # the depths' cross entropies, not zeros
