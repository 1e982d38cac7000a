"""Checkpoint conversion between Hugging Face `transformers` models and ours.

`hf_to_megatron` / `megatron_to_hf` (in `checkpoint.py`) drive the conversion;
each supported architecture has one small mapping module (`gpt2`, `llama`,
`bloom`) that turns an HF config into ModelConfig fields and renames / re-lays
the tensors of the full (TP = 1) model, both ways.
"""


class ConversionError(ValueError):
    """A model or checkpoint cannot be converted; the message says why and what to do."""
