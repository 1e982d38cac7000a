"""Configuration of the GPT model."""
import math
from dataclasses import dataclass
from typing import List, Optional, Union

from megatron.config.errors import require
from megatron.config.mla import MLA_DEFAULTS, check_mla
from megatron.config.moe import MoEConfig, parse_layer_freq

ATTENTION_IMPLS = ("auto", "sdpa", "fused", "torch")
# --fused-kernels-choice (megatron/fused/choice.py's MODES; a unit test keeps them equal).
KERNEL_CHOICES = ("auto", "ours", "plain", "rule")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "alibi", "sinusoidal", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
GLU_ACTIVATIONS = ("swiglu", "geglu", "geglu_tanh", "reglu", "liglu", "quick_geglu")
ROPE_SCALING_TYPES = ("llama3", "yarn")
# Megatron-Core's TransformerConfig.softmax_type (megatron/model/sinks.py).
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
ACTIVATIONS = ("gelu", "openai_gelu", "exact_gelu", "squared_relu") + GLU_ACTIVATIONS
# The fields that make a model what it is: a checkpoint's values are the defaults of a
# run that loads it, a flag that contradicts one is refused, and an exported HF config
# must reproduce each (a MoE section and the scaling fields of the RoPE scaling type too).
ARCHITECTURE_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels",
    "num_query_groups", "position_embedding_type", "rotary_percent", "rotary_base",
    "rotary_seq_len_interpolation_factor", "normalization", "layernorm_epsilon",
    "apply_layernorm_1p", "qk_layernorm", "embed_layernorm", "embedding_multiplier",
    "scale_embeddings", "activation", "add_bias_linear", "add_qkv_bias",
    "untie_embeddings_and_output_weights", "window_size", "window_attn_skip_freq",
    "rotary_base_local", "no_rope_freq", "rope_scaling_type", "sandwich_norm", "softmax_scale",
    "rope_scaling_local", "softmax_type", "glu_linear_offset", "activation_func_clamp_value",
    "mtp_num_layers", "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
    "qk_pos_emb_head_dim", "v_head_dim", "mscale", "mscale_all_dim", "rotary_interleaved",
    "qk_l2_norm", "attention_chunk_size", "attn_temperature_tuning",
    "attn_temperature_floor_scale", "attn_temperature_scale")
# Fields that matter only with the RoPE scaling type they belong to.
SCALING_FIELDS = {
    "llama3": ("rope_scaling_factor", "rope_scaling_low_freq_factor",
               "rope_scaling_high_freq_factor", "rope_scaling_original_max_position_embeddings"),
    "yarn": ("rope_scaling_factor", "rope_scaling_original_max_position_embeddings",
             "yarn_beta_fast", "yarn_beta_slow", "yarn_attention_factor",
             "yarn_correction_range_round_to_int")}
# Run-time switches of the model (recomputation, fusions, kernels, loss details): a resumed
# run takes them from its own flags, never from the checkpoint (a stored store_true switch
# could not be turned off again).
RUN_TIME_FIELDS = (
    "checkpoint_activations", "checkpoint_num_layers", "recompute_granularity",
    "recompute_method", "use_cpu_initialization", "attention_impl", "fused_kernels_choice",
    "attention_softmax_in_fp32", "masked_softmax_fusion", "bias_gelu_fusion",
    "bias_dropout_fusion", "layer_norm_fusion", "fp16_lm_cross_entropy", "mask_vocab_padding",
    "sequence_parallel")


def default_ffn_hidden_size(hidden_size: int, gated: bool) -> int:
    """Megatron-LM's default MLP width: 4h, or 2/3 of it rounded down to 64 for gated MLPs
    (whose first layer has two projections)."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64 if gated else 4 * hidden_size


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
    """MLP inner width (--ffn-hidden-size); when unset 4 x hidden-size, or for a gated
    activation int(4 x hidden-size x 2/3 / 64) x 64, as Megatron-LM."""
    padded_vocab_size: int = 0
    """Vocabulary rows after padding; set from the tokenizer before the model is built."""
    make_vocab_size_divisible_by: int = 128
    """The padded vocabulary is a multiple of this times TP."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of every norm (--norm-epsilon, alias --layernorm-epsilon)."""
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
    recompute_method: Optional[str] = None
    """With full recompute: 'uniform' (every chunk of checkpoint_num_layers layers) or 'block'
    (only the first checkpoint_num_layers layers of each stage); None is uniform (Megatron-LM's)."""
    use_cpu_initialization: bool = False
    """Init full weights from the global seed and slice them: identical across layouts."""
    attention_impl: str = "auto"
    """auto | sdpa (torch scaled_dot_product_attention) | fused (our softmax) | torch."""
    fused_kernels_choice: Optional[str] = None
    """Where a fused kernel and a plain path both apply (attention under auto, the norms, the
    head's exp_sum_): auto (measured on this machine, cached, agreed across ranks) | ours |
    plain | rule (the fixed rules, no timing); None: $MEGATRON_FUSED_KERNELS_CHOICE, else auto."""
    attention_softmax_in_fp32: bool = False
    apply_query_key_layer_scaling: bool = False
    masked_softmax_fusion: bool = True
    bias_gelu_fusion: bool = True
    bias_dropout_fusion: bool = True
    layer_norm_fusion: bool = True
    fp16_lm_cross_entropy: bool = False
    mask_vocab_padding: bool = True
    """Training cross entropy gives the vocabulary-padding ids probability 0, as inference
    does, so the loss is transformers' and the same at every TP size (off with
    --no-mask-vocab-padding: Megatron-LM's loss over all padded rows)."""
    sequence_parallel: bool = False

    # -- architecture (the declarative model spec) ---------------------------
    position_embedding_type: str = "learned_absolute"
    """learned_absolute | rope | alibi | sinusoidal | none (--position-embedding-type);
    sinusoidal is fairseq's fixed table (positions.sinusoidal_table)."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that RoPE rotates, in (0, 1] (--rotary-percent)."""
    rotary_base: int = 10000
    """RoPE frequency base (--rotary-base)."""
    rotary_seq_len_interpolation_factor: Optional[float] = None
    """Positions are divided by this before RoPE (linear interpolation), >= 1."""
    rope_scaling_type: Optional[str] = None
    """RoPE frequency scaling (--rope-scaling-type): llama3 (LLaMA-3.1's, also
    --use-rope-scaling) | yarn; None: none (linear: --rotary-seq-len-interpolation-factor)."""
    rope_scaling_factor: float = 8.0
    """Context extension factor of llama3 / yarn (--rope-scaling-factor; Megatron-LM's 8)."""
    rope_scaling_low_freq_factor: float = 1.0
    """llama3: wavelengths above original / this are fully scaled (--rope-scaling-low-freq-factor)."""
    rope_scaling_high_freq_factor: float = 4.0
    """llama3: wavelengths below original / this are kept (--rope-scaling-high-freq-factor)."""
    rope_scaling_original_max_position_embeddings: int = 8192
    """The pretraining context of llama3 / yarn (--rope-scaling-original-max-position-embeddings)."""
    yarn_beta_fast: float = 32.0
    """yarn: frequencies with more rotations than this over the original context are kept."""
    yarn_beta_slow: float = 1.0
    """yarn: frequencies with fewer rotations than this are fully interpolated."""
    yarn_correction_range_round_to_int: bool = True
    """yarn: the ramp's ends are floored / ceiled to whole channels (HF's truncate; gpt-oss:
    off, --no-yarn-correction-range-round-to-int)."""
    yarn_attention_factor: Optional[float] = None
    """yarn: cos / sin multiplier (--yarn-attention-factor); None: 0.1 ln(factor) + 1."""
    window_size: Optional[int] = None
    """Sliding-window attention (--window-size): a query sees itself and the window_size - 1
    positions before it (Mistral's sliding_window); None: every earlier position."""
    window_attn_skip_freq: Union[int, List[int], str, None] = None
    """Which layers ignore --window-size and attend to every earlier position
    (--window-attn-skip-freq, Megatron-LM's): an int N makes every N-th layer full
    (layer_number % N == 0: gpt-oss 2, Gemma 3 6); Megatron's list form, such as
    ([1]*5+[0]*1)*8, gives each layer 1 = sliding window, 0 = full. None: all windowed."""
    rotary_base_local: Optional[int] = None
    """RoPE base of the sliding-window layers (--rotary-base-local; Gemma 3's
    rope_local_base_freq, 10000 where its full layers use 1000000); None: --rotary-base."""
    rope_scaling_local: bool = True
    """Whether the sliding-window layers' RoPE positions are scaled by
    --rotary-seq-len-interpolation-factor too (off with --no-rope-scaling-local: Gemma 3
    scales its full-attention layers only)."""
    no_rope_freq: Union[int, List[int], str, None] = None
    """Layers without RoPE (--no-rope-freq, Megatron-LM's; Llama 4's NoPE layers): an int N
    leaves out every N-th layer (layer_number % N == 0); the list form gives each layer
    1 = no RoPE, 0 = RoPE. None: RoPE on every layer."""
    rotary_interleaved: bool = False
    """RoPE rotates interleaved channel pairs (x[2i], x[2i + 1]), as complex numbers
    (--rotary-interleaved, Megatron-LM's; Llama 4), instead of the two halves."""
    qk_l2_norm: bool = False
    """Queries and keys of the RoPE layers are L2-normalised per head after RoPE, without
    weight: x / sqrt(mean(x^2) + eps) (--qk-l2-norm, Megatron-LM's; Llama 4's use_qk_norm,
    which leaves the NoPE layers unnormalised)."""
    attention_chunk_size: Optional[int] = None
    """Chunked attention on the RoPE layers (--attention-chunk-size; Llama 4's
    attention_chunk_size): query i sees key j <= i only when i // N == j // N. The NoPE
    layers attend to every earlier position. None: no chunks."""
    attn_temperature_tuning: bool = False
    """Llama 4's attention temperature tuning on the NoPE layers (--attn-temperature-tuning):
    the query at position p is multiplied by log(floor((p + 1) / floor_scale) + 1) x scale + 1."""
    attn_temperature_floor_scale: int = 8192
    """floor_scale of --attn-temperature-tuning (--attn-temperature-floor-scale; HF's floor_scale)."""
    attn_temperature_scale: float = 0.1
    """scale of --attn-temperature-tuning (--attn-temperature-scale; HF's attn_scale)."""
    softmax_type: str = "vanilla"
    """Attention softmax (--softmax-type, Megatron-Core's): vanilla | off-by-one (a fixed 0
    logit joins each denominator) | learnable (a learned sink logit per head, gpt-oss's)."""
    normalization: str = "LayerNorm"
    """LayerNorm | RMSNorm (--normalization)."""
    apply_layernorm_1p: bool = False
    """Norm weights are stored zero-centred and applied as (1 + w) (--apply-layernorm-1p)."""
    qk_layernorm: bool = False
    """Normalise queries and keys per head before attention (--qk-layernorm)."""
    sandwich_norm: bool = False
    """Norms after attention and after the MLP too, on each branch's output before it joins
    the residual stream (--sandwich-norm; Gemma 2 / 3's post_attention_layernorm and
    post_feedforward_layernorm)."""
    softmax_scale: Optional[float] = None
    """Attention scores are q k^T times this (--softmax-scale, Megatron-Core's
    TransformerConfig.softmax_scale; Gemma 3: query_pre_attn_scalar ** -0.5); None:
    1 / sqrt(--kv-channels)."""
    embed_layernorm: bool = False
    """A norm right after the word embeddings, as BLOOM (--embed-layernorm)."""
    embedding_multiplier: float = 1.0
    """Word embeddings are multiplied by this (Gemma: sqrt(hidden-size)) (--embedding-multiplier)."""
    scale_embeddings: bool = False
    """Multiply the word embeddings by sqrt(hidden-size) before positions are added, as
    fairseq's embed_scale (--scale-embeddings); the same product as the multiplier's."""
    activation: str = "gelu"
    """MLP activation: gelu | openai_gelu | exact_gelu (erf in float32, fairseq's) |
    squared_relu, or a gated one: swiglu | geglu | reglu | liglu | geglu_tanh (GeGLU with the
    tanh GeLU, Gemma's) | quick_geglu (x sigmoid(1.702 x) gates, gpt-oss's) (--swiglu,
    --glu-activation, --quick-geglu, --openai-gelu, --exact-gelu, --squared-relu). A gated MLP's
    first weight holds [gate; up] rows (each TP shard its own [gate_r; up_r])."""
    glu_linear_offset: float = 0.0
    """A gated MLP computes act(gate) * (up + this) (--glu-linear-offset; gpt-oss: 1)."""
    activation_func_clamp_value: Optional[float] = None
    """A gated MLP clamps gate to <= this and up to [-this, this] before the activation
    (--activation-func-clamp-value; gpt-oss: 7 with --quick-geglu)."""
    group_query_attention: bool = False
    """Grouped-query attention (--group-query-attention): --num-query-groups K/V heads."""
    num_query_groups: Optional[int] = None
    """Key/value heads; one per query head unless --group-query-attention (1: multi-query)."""
    kv_channels: Optional[int] = None
    """Channels per attention head (--kv-channels); hidden-size / heads when unset."""
    add_bias_linear: bool = True
    """Biases in the linear layers (off with --disable-bias-linear)."""
    add_qkv_bias: bool = False
    """A QKV bias even with --disable-bias-linear (--add-qkv-bias)."""
    untie_embeddings_and_output_weights: bool = False
    """A separate, vocab-parallel output layer instead of the tied word embeddings."""
    pad_vocab_size_to: Optional[int] = None
    """Pad the vocabulary to exactly this many rows (--pad-vocab-size-to)."""
    mtp_num_layers: Optional[int] = None
    """Multi-token prediction depths after the decoder (--mtp-num-layers; None: none), each
    an MTP layer of megatron/model/mtp.py predicting one token further, as Megatron-Core's."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight of the mean of the MTP depths' losses in the training loss
    (--mtp-loss-scaling-factor)."""
    multi_latent_attention: bool = False
    """DeepSeek's multi-latent attention (--multi-latent-attention, megatron/model/mla.py)."""
    q_lora_rank: Optional[int] = MLA_DEFAULTS["q_lora_rank"]
    """MLA: rank of the compressed query (--q-lora-rank); None: no query compression."""
    kv_lora_rank: int = MLA_DEFAULTS["kv_lora_rank"]
    """MLA: rank of the compressed key / value latent (--kv-lora-rank)."""
    qk_head_dim: int = MLA_DEFAULTS["qk_head_dim"]
    """MLA: per-head query / key channels without position (--qk-head-dim)."""
    qk_pos_emb_head_dim: int = MLA_DEFAULTS["qk_pos_emb_head_dim"]
    """MLA: per-head channels of the RoPE query and of the decoupled, shared RoPE key
    (--qk-pos-emb-head-dim)."""
    v_head_dim: int = MLA_DEFAULTS["v_head_dim"]
    """MLA: per-head value channels (--v-head-dim)."""
    mscale: float = MLA_DEFAULTS["mscale"]
    """MLA YaRN: cos / sin magnitude mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    mscale_all_dim: float = MLA_DEFAULTS["mscale_all_dim"]
    """MLA YaRN: the softmax scale is multiplied by mscale(factor, mscale_all_dim)^2."""
    moe: Optional[MoEConfig] = None
    """Mixture of experts (megatron/config/moe.py); None or no --num-experts: dense."""

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = default_ffn_hidden_size(self.hidden_size, self.gated_mlp)
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
        require(self.kv_channels is not None or self.hidden_size % self.num_attention_heads == 0,
                f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
                f"({self.num_attention_heads}), or give --kv-channels")
        require(self.seq_length <= self.max_position_embeddings,
                f"--seq-length ({self.seq_length}) must be <= --max-position-embeddings "
                f"({self.max_position_embeddings})")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            require(0.0 <= value < 1.0, f"--{name.replace('_', '-')} must be in [0, 1), got {value}")
        require(self.attention_impl in ATTENTION_IMPLS,
                f"--attention-impl {self.attention_impl!r} is not one of {ATTENTION_IMPLS}")
        require(self.fused_kernels_choice in (None,) + KERNEL_CHOICES,
                f"--fused-kernels-choice {self.fused_kernels_choice!r} is not one of "
                f"{KERNEL_CHOICES}")
        require(self.recompute_granularity in (None, "full", "selective"),
                f"--recompute-granularity {self.recompute_granularity!r} is not full or selective")
        require(self.recompute_method in (None, "uniform", "block"),
                f"--recompute-method {self.recompute_method!r} is not uniform or block")
        if self.kv_channels is None:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_query_groups is None or not self.group_query_attention:
            self.num_query_groups = self.num_attention_heads
        self._check_architecture()
        if isinstance(self.moe, dict):  # from Config.from_dict
            self.moe = MoEConfig(**self.moe)
        if self.moe is not None and self.moe.enabled:
            self.moe.layer_pattern(self.num_layers)  # validates a list form's length

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether (1-based, global) layer `layer_number` has an MoE MLP; the MTP layers'
        (numbers past --num-layers) are of the last decoder layer's kind, as Megatron-Core's."""
        if self.moe is None or not self.moe.enabled:
            return False
        return bool(self.moe.layer_pattern(self.num_layers)[self._listed(layer_number)])

    def _check_architecture(self):
        for name, value, allowed in (
                ("--position-embedding-type", self.position_embedding_type, POSITION_EMBEDDING_TYPES),
                ("--normalization", self.normalization, NORMALIZATIONS),
                ("--softmax-type", self.softmax_type, SOFTMAX_TYPES),
                ("activation", self.activation, ACTIVATIONS)):
            require(value in allowed, f"{name} {value!r} is not one of {allowed}")
        require(self.softmax_type == "vanilla" or self.position_embedding_type != "alibi",
                f"--softmax-type {self.softmax_type} does not combine with ALiBi; use "
                f"--position-embedding-type rope or --softmax-type vanilla")
        require(0.0 < self.rotary_percent <= 1.0,
                f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
        require(self.rotary_base > 0, f"--rotary-base must be positive, got {self.rotary_base}")
        factor = self.rotary_seq_len_interpolation_factor
        require(factor is None or factor >= 1.0,
                f"--rotary-seq-len-interpolation-factor must be >= 1, got {factor}")
        self._check_long_context()
        self._check_llama4_attention()
        self._check_mtp()
        self._check_glu()
        check_mla(self)
        require(self.kv_channels > 0, f"--kv-channels must be positive, got {self.kv_channels}")
        require(self.position_embedding_type != "rope" or self.rotary_dim > 0,
                f"--rotary-percent {self.rotary_percent} of {self.kv_channels} channels per head "
                f"rotates no channel pair; raise --rotary-percent")
        groups = self.num_query_groups
        require(groups > 0 and self.num_attention_heads % groups == 0,
                f"--num-query-groups ({groups}) must divide --num-attention-heads "
                f"({self.num_attention_heads})")
        require(self.softmax_scale is None or self.softmax_scale > 0,
                f"--softmax-scale must be positive, got {self.softmax_scale}")
        require(self.pad_vocab_size_to is None or self.pad_vocab_size_to > 0,
                f"--pad-vocab-size-to must be positive, got {self.pad_vocab_size_to}")

    def _check_llama4_attention(self):
        """--rotary-interleaved, --qk-l2-norm, --attention-chunk-size and the temperature."""
        rope = self.position_embedding_type == "rope" and not self.multi_latent_attention
        for flag, on in (("--rotary-interleaved", self.rotary_interleaved),
                         ("--qk-l2-norm", self.qk_l2_norm),
                         ("--attention-chunk-size", self.attention_chunk_size is not None),
                         ("--attn-temperature-tuning", self.attn_temperature_tuning)):
            require(not on or rope, f"{flag} needs --position-embedding-type rope (without "
                                    f"--multi-latent-attention), got {self.position_embedding_type}")
        require(not (self.qk_l2_norm and self.qk_layernorm),
                "--qk-l2-norm and --qk-layernorm both normalise queries and keys; choose one")
        chunk = self.attention_chunk_size
        require(chunk is None or chunk > 0,
                f"--attention-chunk-size must be a positive number of positions, got {chunk}")
        require(chunk is None or self.window_size is None,
                f"--attention-chunk-size {chunk} with --window-size {self.window_size} is not "
                f"supported; choose one")
        require(self.attn_temperature_floor_scale > 0 and self.attn_temperature_scale >= 0,
                f"--attn-temperature-floor-scale must be positive and --attn-temperature-scale "
                f">= 0, got {self.attn_temperature_floor_scale} and {self.attn_temperature_scale}")

    def chunk_for_layer(self, layer_number: int) -> Optional[int]:
        """The attention chunk of layer `layer_number` (RoPE layers only); None: no chunks."""
        return self.attention_chunk_size if self.uses_rope(layer_number) else None

    def l2_norm_for_layer(self, layer_number: int) -> bool:
        """Whether layer `layer_number` L2-normalises q and k (--qk-l2-norm, RoPE layers)."""
        return self.qk_l2_norm and self.uses_rope(layer_number)

    def temperature_for_layer(self, layer_number: int) -> bool:
        """Whether layer `layer_number` tunes its attention temperature (NoPE layers)."""
        return self.attn_temperature_tuning and not self.uses_rope(layer_number)

    def _check_mtp(self):
        if self.mtp_num_layers is None:
            return
        require(self.mtp_num_layers > 0, f"--mtp-num-layers must be positive, got "
                                         f"{self.mtp_num_layers}; drop it for no MTP")
        require(self.position_embedding_type in ("rope", "none"),
                f"--mtp-num-layers needs --position-embedding-type rope or none, got "
                f"{self.position_embedding_type} (as Megatron-LM)")

    @property
    def mtp_depths(self) -> int:
        """The number of MTP layers (0 without --mtp-num-layers)."""
        return self.mtp_num_layers or 0

    def _check_glu(self):
        clamp = self.activation_func_clamp_value
        for flag, value in (("--glu-linear-offset", self.glu_linear_offset),
                            ("--activation-func-clamp-value", clamp)):
            require(value in (None, 0.0) or self.gated_mlp,
                    f"{flag} {value} needs a gated activation (--quick-geglu, --swiglu, ...), "
                    f"got {self.activation}")
        require(clamp is None or clamp > 0,
                f"--activation-func-clamp-value must be positive, got {clamp}")

    def _check_long_context(self):
        require(self.window_size is None or self.window_size > 0,
                f"--window-size must be a positive number of positions, got {self.window_size}")
        self._check_layer_kinds()
        kind = self.rope_scaling_type
        require(kind is None or kind in ROPE_SCALING_TYPES,
                f"--rope-scaling-type {kind!r} is not one of {ROPE_SCALING_TYPES} (linear "
                f"scaling: --rotary-seq-len-interpolation-factor)")
        if kind is None:
            return
        require(self.position_embedding_type == "rope" or self.multi_latent_attention,
                f"--rope-scaling-type {kind} needs --position-embedding-type rope, "
                f"got {self.position_embedding_type}")
        require(self.rope_scaling_factor >= 1.0,
                f"--rope-scaling-factor must be >= 1, got {self.rope_scaling_factor}")
        require(self.rope_scaling_original_max_position_embeddings > 0,
                f"--rope-scaling-original-max-position-embeddings must be positive, got "
                f"{self.rope_scaling_original_max_position_embeddings}")
        # equal factors (Llama 4 Scout's published 1.0 and 1.0): a hard cut, no ramp
        require(self.rope_scaling_high_freq_factor >= self.rope_scaling_low_freq_factor > 0,
                f"--rope-scaling-high-freq-factor ({self.rope_scaling_high_freq_factor}) must "
                f"be >= --rope-scaling-low-freq-factor ({self.rope_scaling_low_freq_factor}) > 0")

    def _check_layer_kinds(self):
        self.window_attn_skip_freq = self._layer_flag("--window-attn-skip-freq",
                                                      self.window_attn_skip_freq)
        self.no_rope_freq = self._layer_flag("--no-rope-freq", self.no_rope_freq)
        require(self.window_attn_skip_freq is None or self.window_size is not None,
                "--window-attn-skip-freq chooses the layers without the sliding window; it "
                "needs --window-size")
        require(self.rotary_base_local is None or (
                self.window_size is not None and self.position_embedding_type == "rope"),
                f"--rotary-base-local {self.rotary_base_local} is the RoPE base of the "
                f"sliding-window layers; it needs --window-size and --position-embedding-type rope")
        require(self.rotary_base_local is None or self.rotary_base_local > 0,
                f"--rotary-base-local must be positive, got {self.rotary_base_local}")
        require(self.rope_scaling_local or self.rope_scaling_type is None,
                f"--no-rope-scaling-local leaves the linear scaling "
                f"(--rotary-seq-len-interpolation-factor) out of the sliding-window layers; it "
                f"does not apply to --rope-scaling-type {self.rope_scaling_type}")
        require(self.no_rope_freq is None or self.position_embedding_type == "rope",
                "--no-rope-freq leaves RoPE out of some layers; it needs "
                "--position-embedding-type rope")
        require(not isinstance(self.no_rope_freq, int) or self.num_layers % self.no_rope_freq == 0,
                f"--no-rope-freq {self.no_rope_freq} must divide --num-layers "
                f"({self.num_layers}), as in Megatron-Core; or give the list form")

    def _layer_flag(self, flag: str, value):
        """A per-layer flag's int N (> 0) or one-0/1-per-layer list, parsed from its text."""
        if value is None:
            return None
        value = parse_layer_freq(value, flag) if isinstance(value, str) else value
        if isinstance(value, int):
            require(value > 0, f"{flag} must be positive, got {value}")
            return value
        value = list(value)
        require(len(value) == self.num_layers and set(value) <= {0, 1},
                f"{flag} lists {len(value)} entries of 0/1; it needs one per layer "
                f"({self.num_layers})")
        return value

    def _listed(self, layer_number: int) -> int:
        """The index of (1-based, global) `layer_number` in a per-layer list flag: an MTP
        layer (past --num-layers) takes the last decoder layer's entry."""
        return min(layer_number, self.num_layers) - 1

    def window_for_layer(self, layer_number: int) -> Optional[int]:
        """The sliding window of (1-based, global) layer `layer_number`; None: full attention."""
        freq = self.window_attn_skip_freq
        if self.window_size is None or freq is None:
            return self.window_size
        windowed = (layer_number % freq != 0 if isinstance(freq, int)
                    else freq[self._listed(layer_number)])
        return self.window_size if windowed else None

    def rotary_base_for_layer(self, layer_number: int) -> int:
        """RoPE base of layer `layer_number`: --rotary-base-local on sliding-window layers."""
        if self.rotary_base_local is not None and self.window_for_layer(layer_number) is not None:
            return self.rotary_base_local
        return self.rotary_base

    def rope_scaled_for_layer(self, layer_number: int) -> bool:
        """Whether layer `layer_number` divides its RoPE positions by
        --rotary-seq-len-interpolation-factor: every layer, or with --no-rope-scaling-local
        only the full-attention ones."""
        return self.rope_scaling_local or self.window_for_layer(layer_number) is None

    def uses_rope(self, layer_number: int) -> bool:
        """Whether layer `layer_number` rotates its queries and keys (not a --no-rope-freq layer)."""
        freq = self.no_rope_freq
        if self.position_embedding_type != "rope" or freq is None:
            return self.position_embedding_type == "rope"
        return layer_number % freq != 0 if isinstance(freq, int) else not freq[self._listed(layer_number)]

    def masked_layers(self, seq_length: int) -> List[int]:
        """The layers whose sliding window or attention chunk hides keys of a
        `seq_length`-token sequence."""
        return [n for n in range(1, self.num_layers + 1)
                if (self.window_for_layer(n) or seq_length) < seq_length
                or (self.chunk_for_layer(n) or seq_length) < seq_length]

    @property
    def gated_mlp(self) -> bool:
        """True for the GLU activations: the first MLP weight holds gate and up rows."""
        return self.activation in GLU_ACTIVATIONS

    @property
    def embedding_scale(self) -> float:
        """What the word embeddings are multiplied by (--embedding-multiplier, and sqrt(hidden)
        with --scale-embeddings)."""
        root = math.sqrt(self.hidden_size) if self.scale_embeddings else 1.0
        return self.embedding_multiplier * root

    @property
    def rotary_dim(self) -> int:
        """Channels per head that RoPE rotates (even); MLA: its decoupled RoPE channels."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        return int(self.kv_channels * self.rotary_percent) // 2 * 2

    @property
    def query_projection_size(self) -> int:
        """Input width of the attention's output projection (MLA: heads x v_head_dim)."""
        if self.multi_latent_attention:
            return self.v_head_dim * self.num_attention_heads
        return self.kv_channels * self.num_attention_heads
