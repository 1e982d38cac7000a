"""fairseq language models (`transformer_lm`, Megatron-11b's model-parallel
`transformer_lm_megatron*`) <-> our checkpoints.

`files` finds and reads fairseq's checkpoint files (one `model.pt`, or
`<name>-model_part-K.pt` model-parallel partitions merged by fairseq's splitting
rules) without executing code; `mapping` turns fairseq's args / cfg into
ModelConfig fields and renames the tensors both ways; `convert` drives the
conversion and keeps the fairseq dictionary (dict.txt) with the checkpoint.
"""
from megatron.checkpointing.hf import ConversionError


class FairseqError(ConversionError):
    """A fairseq checkpoint or dictionary cannot be converted; the message says why and what to do."""
