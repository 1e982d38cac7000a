"""Factories that turn the ModelConfig architecture fields into modules and functions.

Adding an architecture means a config field and a branch in one factory here:
`make_norm` (LayerNorm / RMSNorm, optionally zero-centred weights applied as 1 + w),
`make_post_norm` (the sandwich norms on the attention and MLP outputs) and `mlp_activation` (plain or gated). Positions live in `positions.py`; the
attention and MLP layers in `transformer.py` read the config for the rest
(query groups, biases).
"""
import torch
import torch.nn.functional as F

from megatron.config import ModelConfig
from megatron import fused
from megatron.mpu.layers import layer_norm_init_attributes, set_parallel_attributes


class LayerNorm1P(fused.LayerNorm):
    """LayerNorm whose weight is stored zero-centred and applied as 1 + w."""

    def forward(self, x):
        return fused.layer_norm(x, self.weight + 1, self.bias, self.eps, self.fusion)


class RMSNorm1P(fused.RMSNorm):
    """RMSNorm whose weight is stored zero-centred and applied as 1 + w: normalised and
    multiplied by 1 + w in float32, then cast to x's dtype (Gemma's RMSNorm, and Gemma 3's
    q / k norms)."""

    def forward(self, x):
        return fused.rms_norm(x.float(), self.weight.float() + 1, self.eps,
                              self.fusion).type_as(x)


_NORMS = {("LayerNorm", False): fused.LayerNorm, ("LayerNorm", True): LayerNorm1P,
          ("RMSNorm", False): fused.RMSNorm, ("RMSNorm", True): RMSNorm1P}


def make_norm(cfg: ModelConfig, device, dtype, size=None, sequence_parallel=None) -> torch.nn.Module:
    """The configured norm over `size` channels (hidden size by default), replicated over TP.

    `sequence_parallel` (default: the config's) marks its gradients as partial sums
    over the TP group (it sees a slice of the sequence).
    """
    cls = _NORMS[(cfg.normalization, cfg.apply_layernorm_1p)]
    sp = cfg.sequence_parallel if sequence_parallel is None else sequence_parallel
    norm = cls(size or cfg.hidden_size, eps=cfg.layernorm_epsilon, fusion=cfg.layer_norm_fusion,
               sequence_parallel=sp)
    layer_norm_init_attributes(norm)
    if cfg.apply_layernorm_1p:
        set_parallel_attributes(norm.weight, False, init_method=_zeros)
        with torch.no_grad():
            norm.weight.zero_()
    return norm.to(device=device, dtype=dtype)


def make_post_norm(cfg: ModelConfig, device, dtype):
    """The norm of an attention or MLP output before its residual add (--sandwich-norm), else
    None."""
    return make_norm(cfg, device, dtype) if cfg.sandwich_norm else None


def _zeros(tensor, generator=None):
    return tensor.zero_()


def _squared_relu(x):
    return torch.square(F.relu(x))


def _gelu_erf(x):
    return F.gelu(x)


def _gelu_erf_fp32(x):
    """The erf GeLU computed in float32 (fairseq's gelu, also for 16-bit inputs)."""
    return F.gelu(x.float()).type_as(x)


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x):
    """x sigmoid(1.702 x) (Megatron-Core's quick_gelu; gpt-oss's GLU with alpha 1.702)."""
    return x * torch.sigmoid(1.702 * x)


_GATES = {"quick_geglu": _quick_gelu, "swiglu": F.silu, "geglu": _gelu_erf, "geglu_tanh": _gelu_tanh, "reglu": F.relu,
          "liglu": lambda x: x}
_PLAIN = {"openai_gelu": _gelu_tanh, "exact_gelu": _gelu_erf_fp32, "squared_relu": _squared_relu}


def mlp_activation(cfg: ModelConfig):
    """f(x, bias) for the MLP's first output (bias may be None).

    gelu: tanh-approximated GeLU (the fused bias-GeLU path, GPT-2's);
    openai_gelu: the same tanh formula, unfused (Megatron's --openai-gelu, OpenAI's GPT-2
    GeLU); exact_gelu: the erf GeLU in float32 (fairseq's); squared_relu: relu(x)^2; gated ones (GeGLU with the erf GeLU) take the
    rank's [gate; up] halves and return act(gate) * (up + --glu-linear-offset), clamped first
    by --activation-func-clamp-value (`_gated`).
    """
    if cfg.activation == "gelu":
        if cfg.add_bias_linear:
            return lambda x, bias: fused.bias_gelu(bias, x, fusion=cfg.bias_gelu_fusion)
        return lambda x, bias: fused.bias_gelu(None, x, fusion=cfg.bias_gelu_fusion)
    if cfg.gated_mlp:
        return _gated(_GATES[cfg.activation], cfg.glu_linear_offset,
                      cfg.activation_func_clamp_value)
    fn = _PLAIN[cfg.activation]
    return lambda x, bias: fn(x if bias is None else x + bias)


def _gated(gate_fn, offset: float, clamp):
    """act(gate) * (up + offset) of the [gate; up] halves, gate clamped to <= clamp and up
    to [-clamp, clamp] first when clamp is set (Megatron-Core's glu, gpt-oss's experts)."""
    def gated(x, bias):
        if bias is not None:
            x = x + bias
        gate, up = torch.chunk(x, 2, dim=-1)
        if clamp is not None:
            gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
        return gate_fn(gate) * (up + offset if offset else up)
    return gated
