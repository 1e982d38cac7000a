"""The GPT model and its transformer."""
from megatron.model.gpt import GPTModel

__all__ = ["GPTModel"]
