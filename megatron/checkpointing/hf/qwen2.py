"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM) <-> our GPT.

LLaMA's layout (llama.py) with a bias on q/k/v_proj alone: --add-qkv-bias with
--disable-bias-linear. Sliding-window attention (use_sliding_window) is refused.
"""
from megatron.checkpointing.hf import common as c
from megatron.checkpointing.hf import llama

ARCHITECTURES = ("Qwen2ForCausalLM",)
to_megatron, to_hf = llama.to_megatron, llama.to_hf


def decoder_fields(hf: dict, seq_length=None) -> dict:
    """LLaMA's fields of a Qwen-style config, its own biases and window rule apart."""
    c.refuse(bool(hf.get("use_sliding_window")),
             "use_sliding_window is true: sliding-window attention is not supported")
    plain = {k: v for k, v in hf.items() if k not in ("sliding_window", "attention_bias")}
    return llama.model_fields(plain, seq_length)


def model_fields(hf: dict, seq_length=None) -> dict:
    return dict(decoder_fields(hf, seq_length), add_bias_linear=False, add_qkv_bias=True)


def decoder_config(cfg, vocab: int, arch: str, model_type: str) -> dict:
    """LLaMA's HF config renamed to a Qwen architecture (no window, no attention_bias)."""
    hf = llama.hf_config(cfg, vocab)
    for name in ("attention_bias", "mlp_bias"):
        hf.pop(name)
    hf.update(architectures=[arch], model_type=model_type, use_sliding_window=False)
    return hf


def hf_config(cfg, vocab: int) -> dict:
    """The Qwen2Config of a model of ours (checked against `model_fields` by the caller)."""
    return decoder_config(cfg, vocab, ARCHITECTURES[0], "qwen2")
