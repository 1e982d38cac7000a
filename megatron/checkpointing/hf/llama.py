"""LLaMA / Mistral (LlamaForCausalLM, MistralForCausalLM) <-> our GPT.

RoPE (HF's rotate-half convention is ours: q/k_proj need no permutation),
RMSNorm, SwiGLU ([gate; up] rows), grouped-query attention (q/k/v_proj fused
into our grouped QKV rows), untied head unless tie_word_embeddings.
"""
import torch

from megatron.checkpointing.hf import common as c
from megatron.checkpointing.hf.layouts import fuse_qkv, split_qkv

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
P = "model.layers."


def _rope(hf: dict) -> dict:
    """rotary_base and the linear interpolation factor; other scalings are refused."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    params.update(scaling)
    kind = params.get("rope_type", params.get("type", "default"))
    c.refuse(kind not in ("default", "linear"),
             f"rope scaling {kind!r} is not supported (only none or 'linear')")
    theta = float(c.setting(params, "rope_theta", default=hf.get("rope_theta", 10000.0)))
    fields = dict(rotary_base=int(theta) if theta.is_integer() else theta)
    if kind == "linear":
        fields["rotary_seq_len_interpolation_factor"] = float(params["factor"])
    return fields


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
    window = hf.get("sliding_window")
    c.refuse(window is not None and window < seq,
             f"sliding_window {window} is smaller than the sequence length {seq}: sliding-window "
             f"attention is not supported; convert with --seq-length {window} or less")
    return dict(num_layers=hf["num_hidden_layers"], hidden_size=hidden, num_attention_heads=heads,
                group_query_attention=groups != heads, num_query_groups=groups,
                kv_channels=hf.get("head_dim") or hidden // heads,
                ffn_hidden_size=hf["intermediate_size"], max_position_embeddings=positions,
                seq_length=seq, position_embedding_type="rope", normalization="RMSNorm",
                layernorm_epsilon=hf.get("rms_norm_eps", 1e-6), activation="swiglu",
                hidden_dropout=0.0, attention_dropout=float(hf.get("attention_dropout", 0.0)),
                untie_embeddings_and_output_weights=c.untied(hf),
                **_rope(hf), **_biases(hf))


def _kinds(cfg, qkv: bool = False):
    """("weight", "bias") for the linears with a bias (the QKV one also with --add-qkv-bias)."""
    return ("weight", "bias") if cfg.add_bias_linear or (qkv and cfg.add_qkv_bias) else ("weight",)


_QK_NORMS = (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm"))  # Qwen3's per-head RMSNorms


def to_megatron(sd: c.StateDict, hf: dict, cfg) -> c.StateDict:
    out = {c.WORD: c.take(sd, "model.embed_tokens.weight")}
    for i in range(cfg.num_layers):
        src, dst = f"{P}{i}.", c.layer(i)
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
            gate, up = (c.take(sd, f"{src}mlp.{n}_proj.{kind}") for n in ("gate", "up"))
            out[f"{dst}mlp.dense_h_to_4h.{kind}"] = torch.cat([gate, up])
            out[f"{dst}mlp.dense_4h_to_h.{kind}"] = c.take(sd, f"{src}mlp.down_proj.{kind}")
    c.pair_to_megatron(sd, "model.norm.", c.FINAL_NORM, out, bias=False)
    c.head_to_megatron(sd, hf, out)
    return out


def to_hf(flat: c.StateDict, hf: dict, cfg) -> c.StateDict:
    out = {"model.embed_tokens.weight": c.take(flat, c.WORD)}
    for i in range(cfg.num_layers):
        src, dst = c.layer(i), f"{P}{i}."
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
            gate, up = c.take(flat, f"{src}mlp.dense_h_to_4h.{kind}").chunk(2)
            out[f"{dst}mlp.gate_proj.{kind}"] = gate.contiguous()
            out[f"{dst}mlp.up_proj.{kind}"] = up.contiguous()
            out[f"{dst}mlp.down_proj.{kind}"] = c.take(flat, f"{src}mlp.dense_4h_to_h.{kind}")
    c.pair_to_hf(flat, c.FINAL_NORM, "model.norm.", out, bias=False)
    c.head_to_hf(flat, hf, out)
    return out


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
    if cfg.rotary_seq_len_interpolation_factor is not None:
        hf["rope_scaling"] = {"rope_type": "linear",
                              "factor": cfg.rotary_seq_len_interpolation_factor}
    return hf
