"""The supported Hugging Face architectures, each with its mapping module."""
from megatron.config import ConfigError, ModelConfig
from megatron.config.model import ARCHITECTURE_FIELDS, SCALING_FIELDS
from megatron.config.moe import ARCHITECTURE_FIELDS as MOE_FIELDS
from megatron.checkpointing.hf import (ConversionError, bloom, deepseek_v3, gemma, gemma3, gpt2,
                                       gpt_oss, llama, llama4, mixtral, qwen2, qwen3,
                                       qwen_moe)

FAMILIES = {arch: module for module in (gpt2, llama, bloom, qwen2, qwen3, gemma, gemma3, mixtral,
                                        qwen_moe, gpt_oss, deepseek_v3, llama4)
            for arch in module.ARCHITECTURES}
# The HF architectures a model of ours may be exported as, by its position encoding (the
# first that expresses it exactly).
BY_POSITIONS = {"learned_absolute": (gpt2,),
                "rope": (llama, qwen2, qwen3, gemma, gemma3, mixtral, qwen_moe, gpt_oss, deepseek_v3,
                         llama4),
                "alibi": (bloom,)}
# Those of them that hold MoE layers: the only ones tried for an MoE model (so that its error
# names what an MoE architecture lacks rather than the dense MLP), never for a dense one.
WITH_EXPERTS = (mixtral, qwen_moe, gpt_oss, deepseek_v3, llama4)
def family_of(hf_config: dict):
    """The mapping module of the config's architecture (one-line error if unsupported)."""
    names = hf_config.get("architectures") or []
    for name in names:
        if name in FAMILIES:
            return name, FAMILIES[name]
    raise ConversionError(f"architecture {names or hf_config.get('model_type')} is not supported; "
                          f"supported: {', '.join(sorted(FAMILIES))}")


def hf_config_for(cfg: ModelConfig, vocab: int):
    """(architecture, HF config) that describe our model `cfg` exactly, or a one-line error
    naming the first field no supported architecture expresses."""
    families = BY_POSITIONS.get(cfg.position_embedding_type)
    if families is None:
        raise ConversionError(f"--position-embedding-type {cfg.position_embedding_type} has no "
                              f"Hugging Face architecture to export to")
    with_experts = cfg.moe is not None and cfg.moe.enabled
    families = [family for family in families if (family in WITH_EXPERTS) == with_experts] \
        or families
    if cfg.multi_latent_attention:  # dense too: its first_k_dense_replace covers every layer
        families = [deepseek_v3]
    errors = []
    for family in families:
        try:
            return _described(family, cfg, vocab)
        except ConversionError as err:
            errors.append(str(err))
    # The MoE families differ in what they lack (Mixtral: a shared expert; Qwen2-MoE: a
    # shared expert without its gate), so all of theirs are named; a dense model, the first.
    raise ConversionError("; ".join(errors) if with_experts else errors[0])


def _described(family, cfg: ModelConfig, vocab: int):
    """(architecture, HF config) of `family` if it expresses `cfg` exactly."""
    hf = family.hf_config(cfg, vocab)
    arch = hf["architectures"][0]
    try:
        described = ModelConfig(**family.model_fields(hf, cfg.seq_length))
    except ConfigError as err:
        raise ConversionError(f"the model cannot be exported as {arch}: {err}") from None
    names = ARCHITECTURE_FIELDS + SCALING_FIELDS.get(cfg.rope_scaling_type, ())
    if cfg.moe is not None and cfg.moe.enabled and cfg.moe.moe_ffn_hidden_size and \
            all(cfg.is_moe_layer(n) for n in range(1, cfg.num_layers + 1)):
        names = tuple(n for n in names if n != "ffn_hidden_size")  # no dense MLP uses it
    fields = [(name, getattr(cfg, name), getattr(described, name)) for name in names]
    fields += _moe_fields(cfg, described)
    for name, ours, theirs in fields:
        if ours != theirs:
            raise ConversionError(f"{name}={ours} cannot be expressed in {arch} (it would be "
                                  f"{theirs})")
    return arch, hf


def _moe_fields(cfg: ModelConfig, described: ModelConfig):
    """(name, ours, theirs) of what makes the MLPs of the two configs compute the same: MoE
    or dense per layer, and for MoE layers the expert width and the routing."""
    def moe(c):
        return c.moe if c.moe is not None and c.moe.enabled else None

    def pattern(c):
        return [int(c.is_moe_layer(n)) for n in range(1, c.num_layers + 1)]

    ours, theirs = moe(cfg), moe(described)
    fields = [("MoE layers (--num-experts / --moe-layer-freq)", pattern(cfg), pattern(described))]
    if ours is None or theirs is None:
        return fields
    width = [(c.moe_ffn_hidden_size or f) for c, f in ((ours, cfg.ffn_hidden_size),
                                                       (theirs, described.ffn_hidden_size))]
    fields.append(("moe_ffn_hidden_size", *width))
    fields += [(name, getattr(ours, name), getattr(theirs, name)) for name in MOE_FIELDS]
    return fields
