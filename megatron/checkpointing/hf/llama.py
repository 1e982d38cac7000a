"""LLaMA / Mistral (LlamaForCausalLM, MistralForCausalLM) <-> our GPT.

RoPE (HF's rotate-half convention is ours: q/k_proj need no permutation),
RMSNorm, SwiGLU ([gate; up] rows), grouped-query attention (q/k/v_proj fused
into our grouped QKV rows), untied head unless tie_word_embeddings.
"""
import math

import torch

from megatron.checkpointing.hf import common as c
from megatron.checkpointing.hf.layouts import fuse_qkv, split_qkv

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
P = "model.layers."
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope_parameters(hf: dict) -> dict:
    """rope_parameters (transformers 5) updated by rope_scaling (older configs)."""
    params = dict(hf.get("rope_parameters") or {})
    params.update(hf.get("rope_scaling") or {})
    return params


def _llama3_fields(params: dict) -> dict:
    return dict(rope_scaling_type="llama3", rope_scaling_factor=float(params["factor"]),
                rope_scaling_low_freq_factor=float(params["low_freq_factor"]),
                rope_scaling_high_freq_factor=float(params["high_freq_factor"]),
                rope_scaling_original_max_position_embeddings=int(
                    params["original_max_position_embeddings"]))


def _yarn_attention_factor(params: dict, factor: float):
    """HF's yarn attention factor: given, or from mscale / mscale_all_dim, else None
    (ours then derives 0.1 ln(factor) + 1, as HF)."""
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if params.get("attention_factor") is not None or not (mscale and mscale_all_dim):
        value = params.get("attention_factor")
        return None if value is None else float(value)

    def get(m):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    return float(get(mscale) / get(mscale_all_dim))


def _yarn_fields(params: dict, hf: dict) -> dict:
    factor = params.get("factor")
    original = int(params.get("original_max_position_embeddings") or hf["max_position_embeddings"])
    factor = float(factor if factor is not None else hf["max_position_embeddings"] / original)
    return dict(rope_scaling_type="yarn", rope_scaling_factor=factor,
                rope_scaling_original_max_position_embeddings=original,
                yarn_beta_fast=float(params.get("beta_fast") or 32),
                yarn_beta_slow=float(params.get("beta_slow") or 1),
                yarn_correction_range_round_to_int=bool(params.get("truncate", True)),
                yarn_attention_factor=_yarn_attention_factor(params, factor))


def _rope(hf: dict) -> dict:
    """rotary_base and the scaling: linear (the interpolation factor), llama3, yarn."""
    params = _rope_parameters(hf)
    kind = params.get("rope_type", params.get("type", "default"))
    c.refuse(kind not in ROPE_TYPES,
             f"rope scaling {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    theta = float(c.setting(params, "rope_theta", default=hf.get("rope_theta", 10000.0)))
    fields = dict(rotary_base=int(theta) if theta.is_integer() else theta)
    if kind == "linear":
        fields["rotary_seq_len_interpolation_factor"] = float(params["factor"])
    elif kind == "llama3":
        fields.update(_llama3_fields(params))
    elif kind == "yarn":
        fields.update(_yarn_fields(params, hf))
    return fields


def _window(hf: dict) -> dict:
    """Mistral's sliding_window (LlamaForCausalLM ignores the key, as transformers does)."""
    window = hf.get("sliding_window")
    if "MistralForCausalLM" not in (hf.get("architectures") or []) or window is None:
        return {}
    return dict(window_size=int(window))


def _biases(hf: dict) -> dict:
    attention, mlp = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    c.refuse(attention != mlp, f"attention_bias={attention} with mlp_bias={mlp} is not "
                               f"expressible (our output projection has a bias iff the MLP does)")
    return dict(add_bias_linear=attention, add_qkv_bias=attention)


def model_fields(hf: dict, seq_length=None) -> dict:
    act = hf.get("hidden_act", "silu")
    c.refuse(act != "silu", f"hidden_act {act!r} is not supported (only silu: SwiGLU)")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    groups = hf.get("num_key_value_heads") or heads
    positions = hf["max_position_embeddings"]
    seq = c.sequence_length(seq_length, positions)
    return dict(num_layers=hf["num_hidden_layers"], hidden_size=hidden, num_attention_heads=heads,
                group_query_attention=groups != heads, num_query_groups=groups,
                kv_channels=hf.get("head_dim") or hidden // heads,
                ffn_hidden_size=hf["intermediate_size"], max_position_embeddings=positions,
                seq_length=seq, position_embedding_type="rope", normalization="RMSNorm",
                layernorm_epsilon=hf.get("rms_norm_eps", 1e-6), activation="swiglu",
                hidden_dropout=0.0, attention_dropout=float(hf.get("attention_dropout", 0.0)),
                untie_embeddings_and_output_weights=c.untied(hf),
                **_rope(hf), **_biases(hf), **_window(hf))


def _kinds(cfg, qkv: bool = False):
    """("weight", "bias") for the linears with a bias (the QKV one also with --add-qkv-bias)."""
    return ("weight", "bias") if cfg.add_bias_linear or (qkv and cfg.add_qkv_bias) else ("weight",)


_QK_NORMS = (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm"))  # Qwen3's per-head RMSNorms


def attention_to_megatron(sd: c.StateDict, src: str, dst: str, cfg, out: c.StateDict) -> None:
    """One layer's norms and attention (q/k/v fused, Qwen3's q/k norms), HF -> ours; shared
    with the MoE families."""
    c.pair_to_megatron(sd, src + "input_layernorm.", dst + "input_layernorm.", out, bias=False)
    c.pair_to_megatron(sd, src + "post_attention_layernorm.",
                       dst + "post_attention_layernorm.", out, bias=False)
    for kind in _kinds(cfg, qkv=True):
        q, k, v = (c.take(sd, f"{src}self_attn.{n}_proj.{kind}") for n in "qkv")
        out[f"{dst}self_attention.query_key_value.{kind}"] = fuse_qkv(
            q, k, v, cfg.num_query_groups)
    for theirs, ours in _QK_NORMS if cfg.qk_layernorm else ():
        c.pair_to_megatron(sd, f"{src}self_attn.{theirs}.", f"{dst}self_attention.{ours}.",
                           out, bias=False)
    for kind in _kinds(cfg):
        out[f"{dst}self_attention.dense.{kind}"] = c.take(sd, f"{src}self_attn.o_proj.{kind}")


def attention_to_hf(flat: c.StateDict, src: str, dst: str, cfg, out: c.StateDict) -> None:
    """The way back of `attention_to_megatron`."""
    c.pair_to_hf(flat, src + "input_layernorm.", dst + "input_layernorm.", out, bias=False)
    c.pair_to_hf(flat, src + "post_attention_layernorm.",
                 dst + "post_attention_layernorm.", out, bias=False)
    for kind in _kinds(cfg, qkv=True):
        fused = c.take(flat, f"{src}self_attention.query_key_value.{kind}")
        q, k, v = split_qkv(fused, cfg.num_attention_heads, cfg.num_query_groups,
                            cfg.kv_channels)
        out.update({f"{dst}self_attn.q_proj.{kind}": q, f"{dst}self_attn.k_proj.{kind}": k,
                    f"{dst}self_attn.v_proj.{kind}": v})
    for theirs, ours in _QK_NORMS if cfg.qk_layernorm else ():
        c.pair_to_hf(flat, f"{src}self_attention.{ours}.", f"{dst}self_attn.{theirs}.",
                     out, bias=False)
    for kind in _kinds(cfg):
        out[f"{dst}self_attn.o_proj.{kind}"] = c.take(flat, f"{src}self_attention.dense.{kind}")


def decoder_to_megatron(sd: c.StateDict, hf: dict, cfg, mlp_to_megatron) -> c.StateDict:
    """The LLaMA-layout checkpoint (embeddings, attention and norms per layer, final norm,
    head) -> ours, each layer's MLP by `mlp_to_megatron(sd, layer_index, src, dst, cfg,
    out)` (the dense gated MLP here, experts in mixtral.py / qwen_moe.py)."""
    out = {c.WORD: c.take(sd, "model.embed_tokens.weight")}
    for i in range(cfg.num_layers):
        src, dst = f"{P}{i}.", c.layer(i)
        attention_to_megatron(sd, src, dst, cfg, out)
        mlp_to_megatron(sd, i, src, dst, cfg, out)
    c.pair_to_megatron(sd, "model.norm.", c.FINAL_NORM, out, bias=False)
    c.head_to_megatron(sd, hf, out)
    return out


def decoder_to_hf(flat: c.StateDict, hf: dict, cfg, mlp_to_hf) -> c.StateDict:
    """The inverse of `decoder_to_megatron`, each layer's MLP by `mlp_to_hf`."""
    out = {"model.embed_tokens.weight": c.take(flat, c.WORD)}
    for i in range(cfg.num_layers):
        src, dst = c.layer(i), f"{P}{i}."
        attention_to_hf(flat, src, dst, cfg, out)
        mlp_to_hf(flat, i, src, dst, cfg, out)
    c.pair_to_hf(flat, c.FINAL_NORM, "model.norm.", out, bias=False)
    c.head_to_hf(flat, hf, out)
    return out


def _mlp_to_megatron(sd, i, src, dst, cfg, out) -> None:
    for kind in _kinds(cfg):
        gate, up = (c.take(sd, f"{src}mlp.{n}_proj.{kind}") for n in ("gate", "up"))
        out[f"{dst}mlp.dense_h_to_4h.{kind}"] = torch.cat([gate, up])
        out[f"{dst}mlp.dense_4h_to_h.{kind}"] = c.take(sd, f"{src}mlp.down_proj.{kind}")


def _mlp_to_hf(flat, i, src, dst, cfg, out) -> None:
    for kind in _kinds(cfg):
        gate, up = c.take(flat, f"{src}mlp.dense_h_to_4h.{kind}").chunk(2)
        out[f"{dst}mlp.gate_proj.{kind}"] = gate.contiguous()
        out[f"{dst}mlp.up_proj.{kind}"] = up.contiguous()
        out[f"{dst}mlp.down_proj.{kind}"] = c.take(flat, f"{src}mlp.dense_4h_to_h.{kind}")


def to_megatron(sd: c.StateDict, hf: dict, cfg) -> c.StateDict:
    return decoder_to_megatron(sd, hf, cfg, _mlp_to_megatron)


def to_hf(flat: c.StateDict, hf: dict, cfg) -> c.StateDict:
    return decoder_to_hf(flat, hf, cfg, _mlp_to_hf)


def hf_config(cfg, vocab: int) -> dict:
    """The LlamaConfig of a model of ours (checked against `model_fields` by the caller)."""
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
          "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
          "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
          "num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.kv_channels,
          "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": "silu",
          "rms_norm_eps": cfg.layernorm_epsilon, "rope_theta": float(cfg.rotary_base),
          "attention_bias": cfg.add_bias_linear, "mlp_bias": cfg.add_bias_linear,
          "attention_dropout": cfg.attention_dropout,
          "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights}
    scaling = _rope_scaling(cfg)
    if scaling:
        hf["rope_scaling"] = scaling
    if cfg.window_size is not None:
        hf.update(architectures=["MistralForCausalLM"], model_type="mistral",
                  sliding_window=cfg.window_size)
    return hf


def _rope_scaling(cfg) -> dict:
    """The HF rope_scaling entry of our RoPE scaling (empty: none)."""
    if cfg.rotary_seq_len_interpolation_factor is not None:
        return {"rope_type": "linear", "factor": cfg.rotary_seq_len_interpolation_factor}
    original = cfg.rope_scaling_original_max_position_embeddings
    if cfg.rope_scaling_type == "llama3":
        return {"rope_type": "llama3", "factor": cfg.rope_scaling_factor,
                "low_freq_factor": cfg.rope_scaling_low_freq_factor,
                "high_freq_factor": cfg.rope_scaling_high_freq_factor,
                "original_max_position_embeddings": original}
    if cfg.rope_scaling_type == "yarn":
        out = {"rope_type": "yarn", "factor": cfg.rope_scaling_factor,
               "original_max_position_embeddings": original,
               "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow,
               "truncate": cfg.yarn_correction_range_round_to_int}
        if cfg.yarn_attention_factor is not None:
            out["attention_factor"] = cfg.yarn_attention_factor
        return out
    return {}
