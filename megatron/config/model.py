"""Configuration of the GPT model."""
from dataclasses import dataclass
from typing import Optional

from megatron.config.errors import require

ATTENTION_IMPLS = ("auto", "sdpa", "fused", "torch")


@dataclass
class ModelConfig:
    num_layers: int = 24
    """Number of transformer layers (--num-layers)."""
    hidden_size: int = 1024
    """Width of the residual stream (--hidden-size)."""
    num_attention_heads: int = 16
    """Attention heads per layer (--num-attention-heads)."""
    seq_length: int = 1024
    """Tokens per sample fed to the model (--seq-length)."""
    max_position_embeddings: int = 1024
    """Rows of the learned position embedding (--max-position-embeddings)."""
    ffn_hidden_size: Optional[int] = None
    """MLP inner width; 4 x hidden-size when unset (--ffn-hidden-size)."""
    padded_vocab_size: int = 0
    """Vocabulary rows after padding; set from the tokenizer before the model is built."""
    make_vocab_size_divisible_by: int = 128
    """The padded vocabulary is a multiple of this times TP."""
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    """Std of the normal init; output projections use std / sqrt(2 x layers)."""
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    checkpoint_activations: bool = False
    """Recompute each chunk of layers in backward (--checkpoint-activations)."""
    checkpoint_num_layers: int = 1
    """Layers per recomputed chunk."""
    recompute_granularity: Optional[str] = None
    """'full' (whole layers) or 'selective' (attention core only)."""
    use_cpu_initialization: bool = False
    """Init full weights from the global seed and slice them: identical across layouts."""
    attention_impl: str = "auto"
    """auto | sdpa (torch scaled_dot_product_attention) | fused (our softmax) | torch."""
    attention_softmax_in_fp32: bool = False
    apply_query_key_layer_scaling: bool = False
    masked_softmax_fusion: bool = True
    bias_gelu_fusion: bool = True
    bias_dropout_fusion: bool = True
    layer_norm_fusion: bool = True
    fp16_lm_cross_entropy: bool = False
    sequence_parallel: bool = False

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.checkpoint_activations and self.recompute_granularity is None:
            self.recompute_granularity = "full"
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "max_position_embeddings", "ffn_hidden_size", "checkpoint_num_layers"):
            require(getattr(self, name) > 0,
                    f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        require(self.make_vocab_size_divisible_by > 0,
                f"--make-vocab-size-divisible-by must be positive, got {self.make_vocab_size_divisible_by}")
        require(self.layernorm_epsilon > 0, f"--layernorm-epsilon must be positive, got {self.layernorm_epsilon}")
        require(self.init_method_std >= 0, f"--init-method-std must be >= 0, got {self.init_method_std}")
        require(self.hidden_size % self.num_attention_heads == 0,
                f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
                f"({self.num_attention_heads})")
        require(self.seq_length <= self.max_position_embeddings,
                f"--seq-length ({self.seq_length}) must be <= --max-position-embeddings "
                f"({self.max_position_embeddings})")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            require(0.0 <= value < 1.0, f"--{name.replace('_', '-')} must be in [0, 1), got {value}")
        require(self.attention_impl in ATTENTION_IMPLS,
                f"--attention-impl {self.attention_impl!r} is not one of {ATTENTION_IMPLS}")
        require(self.recompute_granularity in (None, "full", "selective"),
                f"--recompute-granularity {self.recompute_granularity!r} is not full or selective")

    @property
    def kv_channels(self) -> int:
        return self.hidden_size // self.num_attention_heads
