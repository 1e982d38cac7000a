"""Ring (p2p) and all-to-all context-parallel attention against one process: outputs
and the gradients of q, k, v, at CP 2 and 4, with grouped keys / values; with attention
sinks also the sinks' gradient."""
import math

import pytest
import torch

from megatron.model.context_parallel import (a2a_attention, cp_token_index, ring_attention,
                                             split_for_cp)
from tests.distributed.run_ranks import run_ranks

S, B, HEADS, GROUPS = 32, 2, 4, 2
D = 16  # the CPU kernel's head sizes: its diagonal ring blocks run fused


def _inputs():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(S, B, HEADS, D, generator=gen)
    k, v = torch.randn(2, S, B, GROUPS, D, generator=gen)
    dout = torch.randn(S, B, HEADS * D, generator=gen)
    return q, k, v, dout


def _expand(t):
    return t.repeat_interleave(HEADS // GROUPS, dim=2)


def _causal(q, k, v, mask=None, sinks=None, heads=None):
    """Reference attention [s, b, h, d] -> [s, b, h * d] (k / v with all heads); sinks: a
    logit per head joining the softmax (its column dropped after), of the heads `heads`
    (a slice, as a2a_attention passes the core attention; None: all)."""
    if sinks is not None and heads is not None:
        sinks = sinks[heads]
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1),
                                float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:
        column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.cat([scores, column], -1).softmax(-1)[..., :-1]
    out = torch.einsum("bhqk,kbhd->qbhd", probs, v)
    return out.reshape(q.shape[0], q.shape[1], -1)


def _run(q, k, v, dout, attend):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _check(rank, world_size):
    import torch.distributed as dist
    group = dist.new_group(list(range(world_size)))
    q, k, v, dout = _inputs()
    expected = _run(q, k, v, dout, lambda q, k, v: _causal(q, _expand(k), _expand(v)))
    local = [split_for_cp(t, rank, world_size, dim=0) for t in (q, k, v, dout)]
    errors = {}
    attends = {"p2p": lambda q, k, v: ring_attention(q, k, v, group),
               "p2p-plain": lambda q, k, v: ring_attention(q, k, v, group, fusion=False),
               "a2a": lambda q, k, v: a2a_attention(q, _expand(k), _expand(v), group, _causal)}
    from megatron.model import context_parallel as cp

    def tiled(q, k, v):
        cp.TILE = 4  # the plain path's 8-row chunks run in tiles of 4 (kernel off)
        try:
            return ring_attention(q, k, v, group, fusion=False)
        finally:
            cp.TILE = 512
    attends["p2p-tiled"] = tiled
    for name, attend in attends.items():
        got = _run(*local, attend)
        want = [split_for_cp(t, rank, world_size, dim=0) for t in expected]
        errors[name] = max(float((g - w).abs().max()) for g, w in zip(got, want))
    errors.update(_sink_errors(rank, world_size, group, q, k, v, dout, local))
    return errors


def _sink_errors(rank, world_size, group, q, k, v, dout, local):
    """Ring (kernel blocks and plain) and a2a attention with attention sinks: outputs, the
    q / k / v gradients and the sinks' gradient (summed over the CP ranks) against one process."""
    from megatron.mpu.mappings import all_reduce
    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(9))

    def run(q, k, v, dout, attend):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        attend(*leaves).backward(dout)
        return [leaves[0].grad, leaves[1].grad, leaves[2].grad, leaves[3].grad]
    want = run(q, k, v, dout, lambda q, k, v, s: _causal(q, _expand(k), _expand(v), sinks=s))
    want = [split_for_cp(t, rank, world_size, dim=0) for t in want[:3]] + [want[3]]
    attends = {
        "p2p-sinks": lambda q, k, v, s: ring_attention(q, k, v, group, sinks=s),
        "p2p-plain-sinks": lambda q, k, v, s: ring_attention(q, k, v, group, fusion=False,
                                                              sinks=s),
        "a2a-sinks": lambda q, k, v, s: a2a_attention(
            q, _expand(k), _expand(v), group,
            lambda q, k, v, mask, heads=None: _causal(q, k, v, sinks=s, heads=heads))}
    errors = {}
    for name, attend in attends.items():
        got = run(*local, attend)
        got[3] = all_reduce(got[3].clone(), group)
        errors[name] = max(float((g - w).abs().max()) for g, w in zip(got, want))
    return errors


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_and_a2a_attention_equal_one_process(cp):
    for errors in run_ranks(_check, cp):
        assert max(errors.values()) < 1e-5, errors


def test_split_holds_chunks_r_and_2cp_minus_1_minus_r():
    assert cp_token_index(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_token_index(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([cp_token_index(24, r, 3) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))


# -- the whole model: gradients of every parameter ---------------------------------

def _llama_cfg(**changes):
    from megatron.config import ModelConfig
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=256,
                  max_position_embeddings=256, position_embedding_type="rope",
                  normalization="RMSNorm", activation="swiglu", group_query_attention=True,
                  num_query_groups=2, add_bias_linear=False,
                  untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                  attention_dropout=0.0, use_cpu_initialization=True, padded_vocab_size=64)
    fields.update(changes)
    return ModelConfig(**fields)


def _loss_and_grads(cfg, tokens, labels, group=None, comm_type="p2p"):
    """Mean token loss and {name: grad} (summed over the CP group) of a fresh model."""
    import torch.distributed as dist
    from megatron.model import GPTModel
    from megatron.model.transformer import enable_context_parallel
    from megatron.model.context_parallel import split_batch_for_cp
    from megatron.mpu.mappings import all_reduce, group_rank, group_size
    model = GPTModel(cfg)
    model.init_weights(1234)
    model.train()
    size, rank = group_size(group), group_rank(group)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    mask = torch.ones_like(tokens, dtype=torch.float32)
    tokens, labels, mask, _, positions = split_batch_for_cp(
        (tokens, labels, mask, None, positions), rank, size)
    enable_context_parallel(model, group, comm_type)
    loss = (model(tokens, positions, labels=labels) * mask).sum() / all_reduce(mask.sum(), group)
    loss.backward()
    grads = {n: all_reduce(p.grad.clone(), group) for n, p in model.named_parameters()}
    return float(all_reduce(loss.detach().clone(), group)), grads


# Gemma 3's layer: sandwich and (1 + w) q / k norms, a softmax scale apart from 1 / sqrt(d)
GEMMA3 = dict(sandwich_norm=True, qk_layernorm=True, apply_layernorm_1p=True, softmax_scale=0.2)


def _model_check(rank, world_size):
    import torch.distributed as dist
    group = dist.new_group(list(range(world_size)))
    gen = torch.Generator().manual_seed(5)
    text = torch.randint(0, 60, (2, 257), generator=gen)
    tokens, labels = text[:, :-1], text[:, 1:]
    errors = {}
    for name, comm, changes in (("p2p", "p2p", {}), ("a2a", "a2a", {}),
                                ("p2p-full-recompute", "p2p", {"recompute_granularity": "full"}),
                                ("a2a-window", "a2a", {"window_size": 48}),
                                ("p2p-gemma3", "p2p", GEMMA3),
                                ("a2a-gemma3-window", "a2a", dict(GEMMA3, window_size=48))):
        cfg = _llama_cfg(**changes)
        ref_loss, ref = _loss_and_grads(cfg, tokens, labels)
        loss, got = _loss_and_grads(cfg, tokens, labels, group, comm)
        worst = max(float((got[n] - g).abs().max() / g.abs().max()) for n, g in ref.items())
        errors[name] = (abs(loss - ref_loss) / ref_loss, worst, len(ref))
    return errors


@pytest.mark.parametrize("cp", [2, 4])
def test_every_parameter_gradient_equals_one_process(cp):
    for errors in run_ranks(_model_check, cp):
        for name, (loss_err, grad_err, count) in errors.items():
            params = 23 if "gemma3" in name else 15  # + 2 sandwich and 2 q / k norms a layer
            assert count == params and loss_err < 1e-6 and grad_err < 1e-5, (name, errors)


@pytest.mark.parametrize("causal", [True, False])
def test_ring_blocks_use_the_cpu_kernel_where_it_applies(causal):
    """The diagonal (causal) and full blocks: the LSE-returning CPU kernel gives the plain
    path's output, log-sum-exp and (with a merged output / lse) gradients."""
    from megatron.fused import kernels
    from megatron.model.context_parallel import _use_kernel, block_backward, block_forward
    if kernels.get_extension("cpu") is None:
        pytest.skip("the CPU fused kernels are not built")
    gen = torch.Generator().manual_seed(2)
    q, k, v, dout = torch.randn(4, 2, 4, 24, 16, generator=gen)
    assert _use_kernel(q, k, causal, True) and not _use_kernel(q, k[:, :, :20], causal, True)
    fused_out, fused_lse = block_forward(q, k, v, 0.25, causal)
    out, lse = block_forward(q, k, v, 0.25, causal, fusion=False)
    torch.testing.assert_close(fused_out, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_lse, lse, rtol=1e-5, atol=1e-6)
    merged_lse = lse + 0.3  # as if another block had been merged into the rows
    got = block_backward(q, k, v, out, merged_lse, dout, 0.25, causal)
    want = block_backward(q, k, v, out, merged_lse, dout, 0.25, causal, fusion=False)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_tiled_blocks_equal_whole_blocks(monkeypatch, causal):
    """Blocks longer than a tile run tile by tile (uneven last tile too), merged by LSE."""
    from megatron.model import context_parallel as cp
    gen = torch.Generator().manual_seed(4)
    q, dout = torch.randn(2, 2, 4, 40, 8, generator=gen)
    k, v = torch.randn(2, 2, 2, 40, 8, generator=gen)
    whole = cp.block_forward(q, k, v, 0.3, causal, fusion=False)
    whole_grads = cp.block_backward(q, k, v, *whole, dout, 0.3, causal, fusion=False)
    monkeypatch.setattr(cp, "TILE", 16)
    tiled = cp.tiled_forward(q, k, v, 0.3, causal, fusion=False)
    tiled_grads = cp.tiled_backward(q, k, v, *whole, dout, 0.3, causal, fusion=False)
    for got, want in zip((*tiled, *tiled_grads), (*whole, *whole_grads)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
