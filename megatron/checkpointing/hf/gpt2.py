"""GPT-2 (GPT2LMHeadModel) <-> our GPT: learned positions, LayerNorm, tanh GeLU, biases.

HF's Conv1D weights are [in, out] (ours are [out, in]) and c_attn's columns are
[q of all heads; k; v], regrouped into our per-head [q, k, v] rows.
"""
import torch

from megatron.checkpointing.hf import common as c
from megatron.checkpointing.hf.layouts import fuse_qkv, split_qkv, transposed

ARCHITECTURES = ("GPT2LMHeadModel",)
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
P = "transformer."


def model_fields(hf: dict, seq_length=None) -> dict:
    act = hf.get("activation_function", "gelu_new")
    c.refuse(act not in TANH_GELUS, f"GPT-2 activation_function {act!r} is not supported "
                                    f"(only the tanh GeLU: {', '.join(TANH_GELUS)})")
    for flag, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                     ("add_cross_attention", False)):
        c.refuse(hf.get(flag, ok) != ok, f"GPT-2 {flag}={hf.get(flag)} is not supported")
    hidden, positions = hf["n_embd"], hf["n_positions"]
    return dict(num_layers=hf["n_layer"], hidden_size=hidden, num_attention_heads=hf["n_head"],
                ffn_hidden_size=hf.get("n_inner") or 4 * hidden,
                max_position_embeddings=positions,
                seq_length=c.sequence_length(seq_length, positions),
                layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
                hidden_dropout=hf.get("resid_pdrop", 0.1),
                attention_dropout=hf.get("attn_pdrop", 0.1),
                untie_embeddings_and_output_weights=c.untied(hf))


def to_megatron(sd: c.StateDict, hf: dict, cfg) -> c.StateDict:
    sd = c.with_prefix(sd, P)
    out = {c.WORD: c.take(sd, P + "wte.weight"), c.POSITIONS: c.take(sd, P + "wpe.weight")}
    heads = cfg.num_attention_heads
    for i in range(cfg.num_layers):
        src, dst = f"{P}h.{i}.", c.layer(i)
        c.pair_to_megatron(sd, src + "ln_1.", dst + "input_layernorm.", out)
        c.pair_to_megatron(sd, src + "ln_2.", dst + "post_attention_layernorm.", out)
        qkv_w = transposed(c.take(sd, src + "attn.c_attn.weight"))
        out[dst + "self_attention.query_key_value.weight"] = fuse_qkv(*qkv_w.chunk(3), heads)
        qkv_b = c.take(sd, src + "attn.c_attn.bias")
        out[dst + "self_attention.query_key_value.bias"] = fuse_qkv(*qkv_b.chunk(3), heads)
        for hf_name, ours in _LINEARS:
            out[dst + ours + ".weight"] = transposed(c.take(sd, src + hf_name + ".weight"))
            out[dst + ours + ".bias"] = c.take(sd, src + hf_name + ".bias")
    c.pair_to_megatron(sd, P + "ln_f.", c.FINAL_NORM, out)
    c.head_to_megatron(sd, hf, out)
    return out


_LINEARS = (("attn.c_proj", "self_attention.dense"), ("mlp.c_fc", "mlp.dense_h_to_4h"),
            ("mlp.c_proj", "mlp.dense_4h_to_h"))


def to_hf(flat: c.StateDict, hf: dict, cfg) -> c.StateDict:
    out = {P + "wte.weight": c.take(flat, c.WORD), P + "wpe.weight": c.take(flat, c.POSITIONS)}
    heads, d = cfg.num_attention_heads, cfg.kv_channels
    for i in range(cfg.num_layers):
        src, dst = c.layer(i), f"{P}h.{i}."
        c.pair_to_hf(flat, src + "input_layernorm.", dst + "ln_1.", out)
        c.pair_to_hf(flat, src + "post_attention_layernorm.", dst + "ln_2.", out)
        for kind in ("weight", "bias"):
            fused = c.take(flat, f"{src}self_attention.query_key_value.{kind}")
            qkv = torch.cat(split_qkv(fused, heads, heads, d))
            out[f"{dst}attn.c_attn.{kind}"] = transposed(qkv) if kind == "weight" else qkv
        for hf_name, ours in _LINEARS:
            out[dst + hf_name + ".weight"] = transposed(c.take(flat, src + ours + ".weight"))
            out[dst + hf_name + ".bias"] = c.take(flat, src + ours + ".bias")
    c.pair_to_hf(flat, c.FINAL_NORM, P + "ln_f.", out)
    c.head_to_hf(flat, hf, out)
    return out


def hf_config(cfg, vocab: int) -> dict:
    """The GPT2Config of a model of ours (checked against `model_fields` by the caller)."""
    return {"architectures": list(ARCHITECTURES), "model_type": "gpt2", "vocab_size": vocab,
            "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
            "n_head": cfg.num_attention_heads, "n_inner": cfg.ffn_hidden_size,
            "n_positions": cfg.max_position_embeddings, "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.layernorm_epsilon, "resid_pdrop": cfg.hidden_dropout,
            "embd_pdrop": cfg.hidden_dropout, "attn_pdrop": cfg.attention_dropout,
            "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights}
