"""Qwen3 (Qwen3ForCausalLM) <-> our GPT.

LLaMA's layout (llama.py) with an RMSNorm over each query and key head before RoPE
(q_norm / k_norm: our --qk-layernorm), head_dim given apart from hidden / heads, and
attention_bias for q/k/v/o_proj (refused: our output projection has a bias only with
the MLP's).
"""
from megatron.checkpointing.hf import common as c
from megatron.checkpointing.hf import llama, qwen2

ARCHITECTURES = ("Qwen3ForCausalLM",)
to_megatron, to_hf = llama.to_megatron, llama.to_hf


def model_fields(hf: dict, seq_length=None) -> dict:
    c.refuse(bool(hf.get("attention_bias")), "attention_bias=True is not supported for Qwen3 "
                                             "(a bias on o_proj without one in the MLP)")
    return dict(qwen2.decoder_fields(hf, seq_length), add_bias_linear=False,
                add_qkv_bias=False, qk_layernorm=True)


def hf_config(cfg, vocab: int) -> dict:
    """The Qwen3Config of a model of ours (checked against `model_fields` by the caller)."""
    return dict(qwen2.decoder_config(cfg, vocab, ARCHITECTURES[0], "qwen3"), attention_bias=False)
