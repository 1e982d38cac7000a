"""The single-process fast paths give what the general ones give: the flat fused Adam,
the norm-and-nonfinite check, and --torch-compile's compiled layers."""
import copy

import pytest
import torch

from megatron.arguments import parse_args
from megatron.config import OptimizerConfig
from megatron.distributed.grads import norm_and_nonfinite
from megatron.model import GPTModel
from megatron.mpu import single_process_state
from megatron.optimizer import MegatronOptimizer
from megatron.optimizer import optimizer as optimizer_module
from megatron.training.parallelize import build_model


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def _steps(optimizer, model, steps=3):
    for i in range(steps):
        torch.manual_seed(100 + i)
        for p in model.parameters():
            p.main_grad = torch.randn_like(p)
        assert optimizer.step()[0]
    return [p.detach().clone() for p in model.parameters()]


def test_flat_adam_matches_torch_adamw_and_loads_its_state(monkeypatch):
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5)
    flat_model, torch_model = _model(), _model()
    flat = MegatronOptimizer(cfg, [flat_model], single_process_state())
    monkeypatch.setattr(optimizer_module, "fused_adamw_available", lambda params: False)
    plain = MegatronOptimizer(cfg, [torch_model], single_process_state())  # torch.optim.AdamW
    assert flat.flat is not None and plain.flat is None
    for a, b in zip(_steps(flat, flat_model), _steps(plain, torch_model)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # A checkpoint of either loads into the other and training continues alike.
    state = copy.deepcopy(plain.state_dict())
    flat.load_state_dict(state)
    with torch.no_grad():
        for a, b in zip(flat_model.parameters(), torch_model.parameters()):
            a.copy_(b)
    for a, b in zip(_steps(flat, flat_model, 2), _steps(plain, torch_model, 2)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    saved = flat.state_dict()["optimizer"]["state"]
    assert int(saved[0]["step"]) == 5
    assert len({id(s["step"]) for s in saved.values()}) == len(saved)  # torch's AdamW advances each


def test_flat_adam_reads_the_reducers_buffers_in_place(monkeypatch):
    """Behind our reducer (two buffers: dense and expert-like parameters, norms and
    matrices interleaved) the flat Adam lays the parameters out in the buffers' order and
    reads the gradients there, without a copy; updates equal torch's AdamW, with clipping
    and with a gradient that stays zero (a parameter that got none)."""
    from megatron.distributed.ddp import GradReducer
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5)
    flat_model, torch_model = _model(), _model()
    reducers = []
    for model in (flat_model, torch_model):
        params = list(model.parameters())
        reducers.append([GradReducer(params[:3], None, torch.float32),
                         GradReducer(params[3:], None, torch.float32)])
    flat = MegatronOptimizer(cfg, [flat_model], single_process_state())
    monkeypatch.setattr(optimizer_module, "fused_adamw_available", lambda params: False)
    plain = MegatronOptimizer(cfg, [torch_model], single_process_state())
    assert flat.flat.reads_in_place and flat.flat.flat_grads is None
    assert len(flat.flat.runs) < len(list(flat_model.parameters()))  # runs, not tensors
    for step in range(3):
        torch.manual_seed(100 + step)
        for pair in zip(reducers[0], reducers[1]):
            for r in pair:
                r.zero_grad()
        for a, b in zip(flat_model.parameters(), torch_model.parameters()):
            if a.ndim == 2 and a.shape[0] == 4:
                continue  # the last layer's weight gets no gradient
            grad = torch.randn_like(a)
            a.main_grad.copy_(grad)
            b.main_grad.copy_(grad)
        assert flat.step()[0] and plain.step()[0]
        for a, b in zip(flat_model.parameters(), torch_model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_norm_and_nonfinite():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    grads = [torch.tensor([3.0, 0.0, 0.0]), torch.tensor([[0.0, 4.0], [0.0, 0.0]])]
    assert norm_and_nonfinite(params, grads, None, None) == (5.0, False)
    grads[1][0, 0] = float("nan")
    assert norm_and_nonfinite(params, grads, None, None)[1]
    params[0].shared_embedding = True  # not counted in the norm, still checked
    grads = [torch.tensor([float("inf"), 0.0, 0.0]), torch.ones(2, 2)]
    norm, nonfinite = norm_and_nonfinite(params, grads, None, None)
    assert nonfinite and norm == pytest.approx(2.0, rel=1e-7)  # float32 partial norms


def test_torch_compile_flag_compiles_each_layer():
    config, _ = parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
                            "--seq-length", "16", "--max-position-embeddings", "16",
                            "--train-iters", "1", "--lr", "1e-4", "--torch-compile"], world_size=1)
    config.model.padded_vocab_size = 64
    (model,) = build_model(config, single_process_state(), torch.device("cpu"),
                           lambda cfg, **chunk: GPTModel(cfg, **chunk))
    layers = model.language_model.encoder.layers
    assert len(layers) == 2 and all(layer._compiled_call_impl is not None for layer in layers)
    assert "language_model.encoder.layers.1.mlp.dense_4h_to_h.weight" in model.state_dict()


def test_cpu_gradient_norms_match_float64_without_float64_copies():
    from megatron.distributed.grads import _float64_norms
    torch.manual_seed(0)
    grads = [torch.randn(8064, 64) * (torch.rand(8064, 1) < 0.05),  # mostly-zero embedding rows
             torch.randn(1_000_003) * (torch.rand(1_000_003) < 0.01),  # a long 1-D shard
             torch.randn(256), torch.randn(()), torch.full((3, 5), 1e30)]  # 1e30: fp32 squares overflow
    expected = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads])
    torch.testing.assert_close(_float64_norms(grads), expected, rtol=1e-7, atol=0)
    grads[2][7] = float("inf")
    grads[3].fill_(float("nan"))
    norms = _float64_norms(grads)
    assert norms[2] == float("inf") and norms[3].isnan() and norms[4].isfinite()


def test_cpu_gradient_norms_of_dim0_shards_add_up_to_the_whole_one():
    """A parameter's gradient norm summed over its dim-0 shards (FSDP's) is the whole
    one's to float64 rounding, so a clipping factor and the update it drives are the same
    bits with and without FSDP; cut in _NORM_ROW pieces from each shard's start, the
    float32 partial norms would differ at ~1e-9."""
    from megatron.distributed.grads import _NORM_ROW, _float64_norms
    torch.manual_seed(0)
    for shape in [(1000, 3 * _NORM_ROW // 2 + 7), (64, 37), (2, 5, _NORM_ROW + 3), (1001,)]:
        whole = torch.randn(shape)
        row = whole[0].numel() if whole.dim() > 1 else 1
        squares = _float64_norms([whole], [0], [row]).square().item()
        for pieces in (2, 3, 4):
            shards = torch.chunk(whole, pieces)
            starts = [sum(s.numel() for s in shards[:i]) for i in range(len(shards))]
            summed = _float64_norms(list(shards), starts, [row] * len(shards)).square().sum()
            assert abs(summed.item() - squares) <= 1e-13 * squares, (shape, pieces)
        exact = torch.linalg.vector_norm(whole, dtype=torch.float64).square().item()
        assert abs(squares - exact) <= 1e-7 * exact, shape
