"""Names and checks shared by the architecture mappings."""
from typing import Dict, Optional

import torch

from megatron.checkpointing.hf import ConversionError

WORD = "language_model.embedding.word_embeddings.weight"
POSITIONS = "language_model.embedding.position_embeddings.weight"
EMBED_NORM = "language_model.embedding.word_embeddings.norm."
FINAL_NORM = "language_model.encoder.final_layernorm."
OUTPUT = "language_model.output_layer.weight"

StateDict = Dict[str, torch.Tensor]


def layer(i: int) -> str:
    """Prefix of our layer `i` (global numbering)."""
    return f"language_model.encoder.layers.{i}."


def take(sd: StateDict, name: str) -> torch.Tensor:
    """sd[name], or a one-line error naming the missing tensor."""
    if name not in sd:
        raise ConversionError(f"the checkpoint has no tensor {name!r}; it does not match its "
                              f"config (wrong architecture or a truncated file?)")
    return sd[name]


def setting(hf: dict, *names, default=None):
    """The first of `names` present in the HF config (old and new spellings)."""
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    return default


def refuse(condition: bool, message: str) -> None:
    if condition:
        raise ConversionError(message)


def sequence_length(requested: Optional[int], max_positions: int) -> int:
    """--seq-length of the converted model: the requested one, else max positions."""
    if requested is None:
        return max_positions
    refuse(not 0 < requested <= max_positions,
           f"--seq-length {requested} must be in 1..{max_positions} (the model's max positions)")
    return requested


def untied(hf: dict) -> bool:
    return not hf.get("tie_word_embeddings", True)


def head_to_megatron(sd: StateDict, hf: dict, out: StateDict) -> None:
    """An untied HF lm_head becomes our output layer (a tied one is the embedding)."""
    if untied(hf):
        out[OUTPUT] = take(sd, "lm_head.weight")


def head_to_hf(flat: StateDict, hf: dict, out: StateDict) -> None:
    if untied(hf):
        out["lm_head.weight"] = take(flat, OUTPUT)


def pair_to_megatron(sd: StateDict, hf_prefix: str, ours: str, out: StateDict,
                     bias: bool = True) -> None:
    """Copy HF `<hf_prefix>weight` (and bias) to our `<ours>weight` (and bias)."""
    out[ours + "weight"] = take(sd, hf_prefix + "weight")
    if bias:
        out[ours + "bias"] = take(sd, hf_prefix + "bias")


def pair_to_hf(flat: StateDict, ours: str, hf_prefix: str, out: StateDict,
               bias: bool = True) -> None:
    out[hf_prefix + "weight"] = take(flat, ours + "weight")
    if bias:
        out[hf_prefix + "bias"] = take(flat, ours + "bias")


def with_prefix(sd: StateDict, prefix: str) -> StateDict:
    """Keys of a base-model file (no `prefix`, as some hub files) prefixed like the LM's."""
    if any(name.startswith(prefix) for name in sd):
        return sd
    return {name if name.startswith("lm_head.") else prefix + name: t for name, t in sd.items()}


def multimodal_text_config(hf: dict, multimodal: str, defaults: dict, arch: str,
                           model_type: str):
    """(text config, one-line note) of a multimodal config.json (Gemma 3's, Llama 4's): its
    text_config over the text model's `defaults`, as the `arch` it is; the note says that
    the vision tower and the multi-modal projector are left out."""
    text = dict(defaults, **(hf.get("text_config") or {}))
    text.update(architectures=[arch], model_type=model_type,
                tie_word_embeddings=hf.get("tie_word_embeddings",
                                           defaults.get("tie_word_embeddings", True)))
    return text, (f"{multimodal}: its text model is imported as {arch}; the vision tower and "
                  f"the multi-modal projector are left out")


def text_model_weights(sd: StateDict, prefixes, heads) -> StateDict:
    """A multimodal file's text model under its CausalLM's names ("model." and lm_head),
    found under the first of `prefixes` present (old and new names), its head the first
    of `heads`; the tensors of a text-only file as they are."""
    for prefix in prefixes:
        if any(name.startswith(prefix) for name in sd):
            out = {"model." + n[len(prefix):]: t for n, t in sd.items() if n.startswith(prefix)}
            found = [sd[n] for n in heads if n in sd]
            if found:
                out["lm_head.weight"] = found[0]
            return out
    return sd
