"""Gemma (GemmaForCausalLM) <-> our GPT.

LLaMA's tensor names and layouts (llama.py) with Gemma's arithmetic: word embeddings
scaled by sqrt(hidden) (--embedding-multiplier), GeGLU with the tanh GeLU
(geglu_tanh), RMSNorm weights stored zero-centred and applied as 1 + w
(--apply-layernorm-1p), head_dim apart from hidden / heads (--kv-channels), and tied
embeddings.
"""
import math

from megatron.checkpointing.hf import common as c
from megatron.checkpointing.hf import llama

ARCHITECTURES = ("GemmaForCausalLM",)
to_megatron, to_hf = llama.to_megatron, llama.to_hf
_TANH_GELUS = ("gelu_pytorch_tanh", "gelu_fast", "gelu_new")


def model_fields(hf: dict, seq_length=None) -> dict:
    act = hf.get("hidden_act") or hf.get("hidden_activation") or "gelu_pytorch_tanh"
    c.refuse(act not in _TANH_GELUS, f"hidden_act {act!r} is not supported for Gemma (only "
                                     f"the tanh GeLU: {', '.join(_TANH_GELUS)})")
    # LLaMA's reading of the shared fields; the activation is Gemma's own
    fields = llama.model_fields(dict(hf, hidden_act="silu"), seq_length)
    return dict(fields, activation="geglu_tanh", apply_layernorm_1p=True,
                embedding_multiplier=math.sqrt(hf["hidden_size"]))


def hf_config(cfg, vocab: int) -> dict:
    """The GemmaConfig of a model of ours (checked against `model_fields` by the caller)."""
    hf = llama.hf_config(cfg, vocab)
    hf.pop("mlp_bias")
    hf.update(architectures=list(ARCHITECTURES), model_type="gemma",
              hidden_act="gelu_pytorch_tanh")
    return hf
