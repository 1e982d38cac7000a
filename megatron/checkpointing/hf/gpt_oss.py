"""gpt-oss (GptOssForCausalLM) <-> our GPT with MoE layers.

Attention is LLaMA's (llama.py: RoPE, grouped q/k/v fused into our QKV rows) with biases
on q/k/v/o (ours --add-bias-linear, which also gives the router and both expert linears
their biases, as gpt-oss has) and a learned sink logit per head (`self_attn.sinks`, ours
--softmax-type learnable: `self_attention.core_attention.softmax_offset`). RoPE is yarn,
its ramp unrounded when truncate is false (--no-yarn-correction-range-round-to-int).
`layer_types` alternates sliding_attention (window `sliding_window`) and full_attention:
ours --window-size with --window-attn-skip-freq (the per-layer pattern).

Every layer is MoE: `mlp.router` (linear with bias; softmax over the top-k logits, our
default routing) and `mlp.experts` with stacked tensors: gate_up_proj [E, h, 2F] whose
columns interleave gate and up (gate = [..., ::2], up = [..., 1::2]) -> our
linear_fc1.weight [E, 2F, h] as [gate; up] rows, gate_up_proj_bias [E, 2F] likewise,
down_proj [E, F, h] -> linear_fc2.weight [E, h, F], down_proj_bias [E, h]. Their
activation: (clamp(up, -limit, limit) + 1) * g sigmoid(1.702 g), g = min(gate, limit):
ours --quick-geglu --glu-linear-offset 1 --activation-func-clamp-value limit.

Released checkpoints store the expert weights in MXFP4 (`*_blocks`, `*_scales`,
quantization_config quant_method mxfp4): they are dequantized on import (`dequantize_mxfp4`)
and exported as plain tensors (without the quantization_config).
"""
import torch

from megatron.checkpointing.hf import common as c
from megatron.checkpointing.hf import llama
from megatron.config import MoEConfig

ARCHITECTURES = ("GptOssForCausalLM",)
ALPHA = 1.702  # gpt-oss's swiglu_alpha: our quick GeLU's constant
# E2M1: the 16 values of a 4-bit code (sign bit 3), transformers' FP4_VALUES.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# -- the config ------------------------------------------------------------------------
def layer_windows(hf: dict) -> list:
    """1 for each sliding_attention layer, 0 for each full_attention one."""
    kinds = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                      for i in range(hf["num_hidden_layers"])]
    unknown = sorted(set(kinds) - {"sliding_attention", "full_attention"})
    c.refuse(bool(unknown), f"layer_types {unknown} are not supported (only sliding_attention "
                            f"and full_attention)")
    c.refuse(len(kinds) != hf["num_hidden_layers"],
             f"layer_types lists {len(kinds)} layers, the model has {hf['num_hidden_layers']}")
    return [int(kind == "sliding_attention") for kind in kinds]


def skip_freq(pattern: list):
    """--window-attn-skip-freq of a per-layer pattern (1 = sliding window): the int N when
    every N-th layer is full and the others sliding, else the list."""
    for n in range(1, len(pattern) + 1):
        if pattern == [0 if (i + 1) % n == 0 else 1 for i in range(len(pattern))]:
            return n
    return list(pattern)


def _window_fields(hf: dict) -> dict:
    pattern = layer_windows(hf)
    if not any(pattern) or hf.get("sliding_window") is None:
        return {}
    fields = dict(window_size=int(hf["sliding_window"]))
    if not all(pattern):
        fields["window_attn_skip_freq"] = skip_freq(pattern)
    return fields


def model_fields(hf: dict, seq_length=None) -> dict:
    c.refuse(not hf.get("attention_bias", True), "gpt-oss with attention_bias=false is not "
             "expressible (our router and experts have biases iff attention does)")
    alpha = float(hf.get("swiglu_alpha", ALPHA))
    c.refuse(alpha != ALPHA, f"swiglu_alpha {alpha} is not supported (only {ALPHA}: the quick "
                             f"GeLU of --quick-geglu)")
    base = dict(hf, hidden_act="silu", attention_bias=True, mlp_bias=True,
                architectures=["LlamaForCausalLM"], sliding_window=None)
    fields = llama.model_fields(base, seq_length)
    fields.update(add_qkv_bias=False,  # implied by add_bias_linear, as a model trained here has
                  activation="quick_geglu", glu_linear_offset=1.0,
                  activation_func_clamp_value=float(hf.get("swiglu_limit", 7.0)),
                  softmax_type="learnable", **_window_fields(hf))
    fields["moe"] = MoEConfig(num_experts=hf["num_local_experts"],
                              moe_router_topk=hf["num_experts_per_tok"],
                              moe_ffn_hidden_size=hf["intermediate_size"],
                              moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)))
    return fields


def hf_config(cfg, vocab: int) -> dict:
    """The GptOssConfig of a model of ours (checked against `model_fields` by the caller)."""
    hf = llama.hf_config(cfg, vocab)
    for key in ("mlp_bias", "hidden_act", "architectures", "model_type", "sliding_window"):
        hf.pop(key, None)
    moe = cfg.moe
    kinds = ["sliding_attention" if cfg.window_for_layer(n) is not None else "full_attention"
             for n in range(1, cfg.num_layers + 1)]
    hf.update(architectures=["GptOssForCausalLM"], model_type="gpt_oss",
              intermediate_size=moe.moe_ffn_hidden_size or cfg.ffn_hidden_size,
              num_local_experts=moe.num_experts, num_experts_per_tok=moe.moe_router_topk,
              router_aux_loss_coef=moe.moe_aux_loss_coeff, swiglu_alpha=ALPHA,
              swiglu_limit=cfg.activation_func_clamp_value, layer_types=kinds,
              sliding_window=cfg.window_size, rope_parameters=_rope_parameters(cfg))
    hf.pop("rope_scaling", None)
    hf.pop("rope_theta", None)
    return hf


def _rope_parameters(cfg) -> dict:
    params = dict(llama._rope_scaling(cfg))
    params.setdefault("rope_type", "default")
    params["rope_theta"] = float(cfg.rotary_base)
    return params


# -- MXFP4 ---------------------------------------------------------------------------------
def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype=torch.float32) -> torch.Tensor:
    """MXFP4 -> [E, out, in]: blocks uint8 [E, out, in / 32, 16] hold two E2M1 codes a byte
    (the low nibble first), scales uint8 [E, out, in / 32] an E8M0 exponent (bias 127) per
    block of 32 values. (transformers then transposes to its [E, in, out] parameters.)"""
    c.refuse(blocks.shape[:-1] != scales.shape,
             f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    codes = blocks.to(torch.uint8)
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack([table[(codes & 0x0F).long()], table[(codes >> 4).long()]], dim=-1)
    values = values.flatten(-2)  # [E, out, in / 32, 32]
    exponents = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exponents[..., None].to(torch.float32))
    return values.flatten(-2).to(dtype)


def _expert_tensor(sd, name: str, dtype) -> torch.Tensor:
    """HF's expert tensor `name` ([E, in, out]), dequantized from MXFP4 if stored so."""
    if f"{name}_blocks" in sd:
        blocks, scales = c.take(sd, f"{name}_blocks"), c.take(sd, f"{name}_scales")
        return dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2)
    return c.take(sd, name)


def _dtype(sd) -> torch.dtype:
    """The floating dtype of the checkpoint's other tensors (dequantized experts get it)."""
    return next((t.dtype for t in sd.values() if t.is_floating_point()), torch.float32)


# -- tensors -------------------------------------------------------------------------------
def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved [g0, u0, g1, u1, ...] along `dim` -> [gate; up]."""
    index = torch.arange(t.shape[dim])
    return torch.cat([t.index_select(dim, index[0::2]), t.index_select(dim, index[1::2])], dim)


def _interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[gate; up] along `dim` -> interleaved, the inverse of `_deinterleave`."""
    gate, up = t.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def experts_to_megatron(sd, src: str, dst: str, dtype, out) -> None:
    """One layer's router and experts, HF -> ours."""
    e = f"{src}mlp.experts."
    gate_up = _expert_tensor(sd, e + "gate_up_proj", dtype)  # [E, h, 2F]
    out[f"{dst}mlp.experts.linear_fc1.weight"] = _deinterleave(gate_up.transpose(1, 2), 1)
    out[f"{dst}mlp.experts.linear_fc1.bias"] = _deinterleave(c.take(sd, e + "gate_up_proj_bias"), 1)
    down = _expert_tensor(sd, e + "down_proj", dtype)  # [E, F, h]
    out[f"{dst}mlp.experts.linear_fc2.weight"] = down.transpose(1, 2).contiguous()
    out[f"{dst}mlp.experts.linear_fc2.bias"] = c.take(sd, e + "down_proj_bias")
    c.pair_to_megatron(sd, f"{src}mlp.router.", f"{dst}mlp.router.", out)


def experts_to_hf(flat, src: str, dst: str, out) -> None:
    e = f"{dst}mlp.experts."
    fc1 = c.take(flat, f"{src}mlp.experts.linear_fc1.weight")
    out[e + "gate_up_proj"] = _interleave(fc1, 1).transpose(1, 2).contiguous()
    out[e + "gate_up_proj_bias"] = _interleave(c.take(flat, f"{src}mlp.experts.linear_fc1.bias"), 1)
    out[e + "down_proj"] = c.take(flat, f"{src}mlp.experts.linear_fc2.weight").transpose(
        1, 2).contiguous()
    out[e + "down_proj_bias"] = c.take(flat, f"{src}mlp.experts.linear_fc2.bias")
    c.pair_to_hf(flat, f"{src}mlp.router.", f"{dst}mlp.router.", out)


SINKS = ("self_attn.sinks", "self_attention.core_attention.softmax_offset")


def to_megatron(sd: c.StateDict, hf: dict, cfg) -> c.StateDict:
    dtype = _dtype(sd)

    def mlp(sd, i, src, dst, cfg, out):
        experts_to_megatron(sd, src, dst, dtype, out)
        out[dst + SINKS[1]] = c.take(sd, src + SINKS[0])
    return llama.decoder_to_megatron(sd, hf, cfg, mlp)


def to_hf(flat: c.StateDict, hf: dict, cfg) -> c.StateDict:
    """Ours -> HF tensors; the experts leave as plain tensors, so an imported MXFP4 config
    loses its quantization_config here (`hf` is the export's config)."""
    hf.pop("quantization_config", None)

    def mlp(flat, i, src, dst, cfg, out):
        experts_to_hf(flat, src, dst, out)
        out[dst + SINKS[0]] = c.take(flat, src + SINKS[1])
    return llama.decoder_to_hf(flat, hf, cfg, mlp)
