"""BLOOM (BloomForCausalLM) <-> our GPT: ALiBi, an embedding layer norm, tanh GeLU, biases.

BLOOM's query_key_value rows are already per head [q, k, v] (ours); the head is
tied to the word embeddings. BLOOM has no position table, so the converted
model's max positions are --seq-length (default 2048, BLOOM's training length).
"""
from megatron.checkpointing.hf import common as c

ARCHITECTURES = ("BloomForCausalLM",)
P = "transformer."
DEFAULT_SEQ_LENGTH = 2048
_LAYER_TENSORS = ("input_layernorm", "self_attention.query_key_value", "self_attention.dense",
                  "post_attention_layernorm", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")


def model_fields(hf: dict, seq_length=None) -> dict:
    c.refuse(hf.get("apply_residual_connection_post_layernorm", False),
             "BLOOM apply_residual_connection_post_layernorm=True is not supported")
    hidden = c.setting(hf, "hidden_size", "n_embed")
    seq = seq_length or DEFAULT_SEQ_LENGTH
    return dict(num_layers=hf["n_layer"], hidden_size=hidden, num_attention_heads=hf["n_head"],
                ffn_hidden_size=4 * hidden, max_position_embeddings=seq, seq_length=seq,
                position_embedding_type="alibi", embed_layernorm=True,
                layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
                hidden_dropout=float(hf.get("hidden_dropout", 0.0)),
                attention_dropout=float(hf.get("attention_dropout", 0.0)),
                untie_embeddings_and_output_weights=c.untied(hf))


def to_megatron(sd: c.StateDict, hf: dict, cfg) -> c.StateDict:
    sd = c.with_prefix(sd, P)
    out = {c.WORD: c.take(sd, P + "word_embeddings.weight")}
    c.pair_to_megatron(sd, P + "word_embeddings_layernorm.", c.EMBED_NORM, out)
    for i in range(cfg.num_layers):
        for name in _LAYER_TENSORS:
            c.pair_to_megatron(sd, f"{P}h.{i}.{name}.", f"{c.layer(i)}{name}.", out)
    c.pair_to_megatron(sd, P + "ln_f.", c.FINAL_NORM, out)
    c.head_to_megatron(sd, hf, out)
    return out


def to_hf(flat: c.StateDict, hf: dict, cfg) -> c.StateDict:
    out = {P + "word_embeddings.weight": c.take(flat, c.WORD)}
    c.pair_to_hf(flat, c.EMBED_NORM, P + "word_embeddings_layernorm.", out)
    for i in range(cfg.num_layers):
        for name in _LAYER_TENSORS:
            c.pair_to_hf(flat, f"{c.layer(i)}{name}.", f"{P}h.{i}.{name}.", out)
    c.pair_to_hf(flat, c.FINAL_NORM, P + "ln_f.", out)
    c.head_to_hf(flat, hf, out)
    return out


def hf_config(cfg, vocab: int) -> dict:
    """The BloomConfig of a model of ours (checked against `model_fields` by the caller)."""
    return {"architectures": list(ARCHITECTURES), "model_type": "bloom", "vocab_size": vocab,
            "hidden_size": cfg.hidden_size, "n_layer": cfg.num_layers,
            "n_head": cfg.num_attention_heads, "layer_norm_epsilon": cfg.layernorm_epsilon,
            "hidden_dropout": cfg.hidden_dropout, "attention_dropout": cfg.attention_dropout,
            "apply_residual_connection_post_layernorm": False,
            "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights}
