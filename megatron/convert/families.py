"""The supported Hugging Face architectures, each with its mapping module."""
from megatron.convert import ConversionError, bloom, gpt2, llama

FAMILIES = {arch: module for module in (gpt2, llama, bloom) for arch in module.ARCHITECTURES}


def family_of(hf_config: dict):
    """The mapping module of the config's architecture (one-line error if unsupported)."""
    names = hf_config.get("architectures") or []
    for name in names:
        if name in FAMILIES:
            return name, FAMILIES[name]
    raise ConversionError(f"architecture {names or hf_config.get('model_type')} is not supported; "
                          f"supported: {', '.join(sorted(FAMILIES))}")
