"""Checkpoint conversion between Hugging Face `transformers` models and ours.

    convert.py      hf_to_megatron / megatron_to_hf: the drivers (behind
                    tools/convert_checkpoint.py), at any target TP / PP
    families.py     FAMILIES: each architecture name -> its family module; which family a
                    model of ours exports as
    hf_files.py     config.json + safetensors (sharded too) read and written
    common.py       shared key names and tensor helpers; layouts.py: QKV fusing, padding
  one module per family (each satisfies `Family` below):
    gpt2.py (GPT2LMHeadModel), llama.py (Llama, Mistral), gemma.py, qwen2.py, qwen3.py,
    bloom.py, mixtral.py, qwen_moe.py (Qwen2-MoE, Qwen3-MoE), gemma3.py, gpt_oss.py,
    deepseek_v3.py, llama4.py (Llama 4 text)

Adding a family is its module and its name in families.py's FAMILIES (and BY_POSITIONS when
models trained here may export as it).
"""
from typing import Dict, Protocol, Tuple

import torch


class ConversionError(ValueError):
    """A model or checkpoint cannot be converted; the message says why and what to do."""


class Family(Protocol):
    """What one architecture family's module provides. Tensors are the full (TP 1) model:
    HF's names on one side, ours (megatron.checkpointing.model_file's flat names) on the
    other; the vocabulary padding is the driver's."""

    ARCHITECTURES: Tuple[str, ...]
    """The `architectures` names of config.json this module converts."""

    def model_fields(self, hf: dict, seq_length=None) -> dict:
        """ModelConfig fields from an HF config (raising ConversionError for what our model
        cannot express); `seq_length` overrides the stored training length."""

    def to_megatron(self, sd: Dict[str, torch.Tensor], hf: dict, cfg) -> Dict[str, torch.Tensor]:
        """HF tensors -> ours, for the model `cfg` (a ModelConfig) builds."""

    def to_hf(self, flat: Dict[str, torch.Tensor], hf: dict, cfg) -> Dict[str, torch.Tensor]:
        """Ours -> HF tensors; every tensor of `flat` must be used."""

    def hf_config(self, cfg, vocab: int) -> dict:
        """The HF config that describes our model `cfg` with `vocab` rows exactly (raising
        ConversionError naming the first field it cannot express)."""
