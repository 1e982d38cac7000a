"""Multi-latent attention (DeepSeek-V2/V3's MLA; Megatron-LM's --multi-latent-attention flags).

The fields live on ModelConfig (megatron/config/model.py); `check_mla` validates them there,
with one line naming the value and the fix.
"""
import math

from megatron.config.errors import require

# ModelConfig fields that only an MLA model may set away from their defaults.
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
              "mscale", "mscale_all_dim")
# Position encodings MLA combines with (its own RoPE always; Megatron-Core adds learned
# absolute embeddings to the input when asked, and so do we).
MLA_POSITIONS = ("rope", "learned_absolute")
# Megatron-LM's defaults (arguments.py, _add_mla_args); a flag left unset keeps them.
MLA_DEFAULTS = {"q_lora_rank": None, "kv_lora_rank": 32, "qk_head_dim": 128,
                "qk_pos_emb_head_dim": 64, "v_head_dim": 128, "mscale": 1.0, "mscale_all_dim": 0.0}


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's YaRN magnitude 0.1 mscale ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def check_mla(cfg) -> None:
    """Raise ConfigError for an inconsistent MLA setting of ModelConfig `cfg`."""
    if not cfg.multi_latent_attention:
        for name in MLA_FIELDS:
            require(getattr(cfg, name) == MLA_DEFAULTS[name],
                    f"--{name.replace('_', '-')} {getattr(cfg, name)} needs "
                    f"--multi-latent-attention; add it or drop the flag")
        return
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        require(getattr(cfg, name) > 0,
                f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    require(cfg.q_lora_rank is None or cfg.q_lora_rank > 0,
            f"--q-lora-rank must be positive (or unset: no query compression), got "
            f"{cfg.q_lora_rank}")
    require(cfg.qk_pos_emb_head_dim % 2 == 0,
            f"--qk-pos-emb-head-dim must be even (RoPE rotates channel pairs), got "
            f"{cfg.qk_pos_emb_head_dim}")
    require(cfg.position_embedding_type in MLA_POSITIONS,
            f"--multi-latent-attention rotates its decoupled key with RoPE (learned absolute "
            f"positions may come on top, as in Megatron-Core); --position-embedding-type "
            f"{cfg.position_embedding_type} is not supported, use rope")
    require(not cfg.group_query_attention,
            "--multi-latent-attention has one latent for all heads; drop --group-query-attention")
    require(not cfg.qk_layernorm,
            "--multi-latent-attention always normalises the compressed query and KV; "
            "drop --qk-layernorm")
    require(cfg.window_size is None and cfg.rotary_percent == 1.0,
            "--multi-latent-attention supports neither --window-size nor --rotary-percent < 1")
    require(cfg.softmax_scale is None,
            f"--multi-latent-attention scales its scores by 1/sqrt(--qk-head-dim + "
            f"--qk-pos-emb-head-dim) (and YaRN's --mscale-all-dim); drop --softmax-scale "
            f"{cfg.softmax_scale}")
    require(cfg.mscale > 0 and cfg.mscale_all_dim >= 0,
            f"--mscale must be positive and --mscale-all-dim >= 0, got {cfg.mscale} and "
            f"{cfg.mscale_all_dim}")


def rope_magnitude(cfg) -> float:
    """The cos / sin multiplier of MLA's YaRN RoPE: mscale(f, mscale) / mscale(f,
    mscale_all_dim) (DeepSeek's and Megatron-Core's), unless --yarn-attention-factor."""
    if cfg.yarn_attention_factor is not None:
        return cfg.yarn_attention_factor
    f = cfg.rope_scaling_factor
    return yarn_mscale(f, cfg.mscale) / yarn_mscale(f, cfg.mscale_all_dim)


def softmax_scale(cfg) -> float:
    """MLA's softmax scale: mscale(f, mscale_all_dim)^2 / sqrt(qk_head_dim +
    qk_pos_emb_head_dim) under YaRN, else 1 / sqrt(that head size)."""
    scale = 1.0 / math.sqrt(cfg.qk_head_dim + cfg.qk_pos_emb_head_dim)
    if cfg.rope_scaling_type == "yarn":
        scale *= yarn_mscale(cfg.rope_scaling_factor, cfg.mscale_all_dim) ** 2
    return scale
