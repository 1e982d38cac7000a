"""Relative position encodings applied inside attention: RoPE and ALiBi.

RoPE uses the "rotate half" convention (Hugging Face LlamaForCausalLM's): of each
head's first `rotary_dim` channels, x1 = the first half and x2 = the second, and
out = x * cos + cat(-x2, x1) * sin; channels past `rotary_dim` pass through. With
--rotary-interleaved (Llama 4's complex rotation) the pairs are (x[2i], x[2i + 1]) instead.

ALiBi adds slope_h * (key position) to the attention scores of head h (equal to
slope_h * (j - i) up to a per-row shift, which softmax ignores). The slopes follow
the ALiBi paper / BLOOM: a geometric sequence for the closest power of two below
the head count, then every other slope of the next power of two.

RoPE frequency scalings (`--rope-scaling-type`, as Hugging Face's `rope_type`):
llama3 (LLaMA-3.1: long wavelengths divided by the factor, short ones kept, a smooth
ramp between) and yarn (per-frequency blend of interpolated and original frequencies,
cos / sin multiplied by the attention factor); linear scaling divides the positions
(--rotary-seq-len-interpolation-factor).
"""
import math

import torch

from megatron.config import ModelConfig


def _llama3_inv_freq(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """LLaMA-3.1's scaling: wavelengths above original / low_freq_factor are divided by the
    factor, those below original / high_freq_factor kept, a linear ramp in between."""
    factor, low, high = (cfg.rope_scaling_factor, cfg.rope_scaling_low_freq_factor,
                         cfg.rope_scaling_high_freq_factor)
    original = cfg.rope_scaling_original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, smoothed, scaled)


def yarn_attention_factor(cfg: ModelConfig) -> float:
    """YaRN's cos / sin multiplier: --yarn-attention-factor, else 0.1 ln(factor) + 1."""
    if cfg.yarn_attention_factor is not None:
        return cfg.yarn_attention_factor
    return 1.0 if cfg.rope_scaling_factor <= 1 else 0.1 * math.log(cfg.rope_scaling_factor) + 1.0


def _yarn_inv_freq(dim: int, base: float, cfg: ModelConfig, device) -> torch.Tensor:
    """YaRN: original frequencies above beta_fast rotations over the original context,
    interpolated (divided by the factor) below beta_slow, a linear ramp between."""
    original = cfg.rope_scaling_original_max_position_embeddings

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(cfg.yarn_beta_fast), correction_dim(cfg.yarn_beta_slow)
    if cfg.yarn_correction_range_round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).to(device)
    return (1.0 / (cfg.rope_scaling_factor * pos_freqs)) * (1 - extrapolation) + \
        (1.0 / pos_freqs) * extrapolation


def rope_inv_freq(cfg: ModelConfig, device=None, base=None) -> torch.Tensor:
    """The rotary_dim / 2 inverse frequencies of RoPE base `base` (default --rotary-base),
    scaled by --rope-scaling-type."""
    dim, base = cfg.rotary_dim, base or cfg.rotary_base
    if cfg.rope_scaling_type == "yarn":
        return _yarn_inv_freq(dim, base, cfg, device)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    if cfg.rope_scaling_type == "llama3":
        return _llama3_inv_freq(inv_freq, cfg)
    return inv_freq


class RotaryEmbedding(torch.nn.Module):
    """cos / sin tables of the positions being processed; holds no parameters."""

    def __init__(self, cfg: ModelConfig, base=None, scaled: bool = True):
        super().__init__()
        self.cfg = cfg
        self.base = base or cfg.rotary_base
        # scaled=False: a layer whose positions are not interpolated (--no-rope-scaling-local)
        self.interpolation = cfg.rotary_seq_len_interpolation_factor if scaled else None
        self.magnitude = yarn_attention_factor(cfg) if cfg.rope_scaling_type == "yarn" else 1.0

    def forward(self, seq_len: int, offset: int, device, positions=None):
        """(cos, sin), each [seq_len, 1, 1, rotary_dim], for positions offset .. offset +
        seq_len - 1, or for the given float `positions` [seq_len]."""
        inv_freq = rope_inv_freq(self.cfg, device, self.base)
        if positions is None:
            positions = torch.arange(offset, offset + seq_len, dtype=torch.float32, device=device)
        if self.interpolation is not None:
            positions = positions / self.interpolation
        freqs = torch.outer(positions, inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        if self.magnitude != 1.0:
            return angles.cos() * self.magnitude, angles.sin() * self.magnitude
        return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool = False) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of x [s, b, heads, head_dim]: their halves,
    or with `interleaved` their pairs (x[2i], x[2i + 1]) (cos / sin as RotaryEmbedding
    gives them: [freqs, freqs])."""
    d = cos.shape[-1]
    rot, rest = x[..., :d], x[..., d:]
    if interleaved:
        c, s = cos[..., :d // 2], sin[..., :d // 2]
        x1, x2 = rot[..., 0::2].float(), rot[..., 1::2].float()
        rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2).to(x.dtype)
        return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated
    x1, x2 = rot[..., :d // 2], rot[..., d // 2:]
    rotated = (rot.float() * cos + torch.cat((-x2, x1), dim=-1).float() * sin).to(x.dtype)
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi slope of every head (global head order), float32 [num_heads]."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-8.0 / closest)
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest < num_heads:
        extra_base = 2.0 ** (-4.0 / closest)  # = 2 ** (-8 / (2 * closest))
        slopes += [extra_base ** i for i in range(1, 2 * (num_heads - closest), 2)]
    return torch.tensor(slopes, dtype=torch.float32)


class AlibiBias(torch.nn.Module):
    """The score bias of this TP rank's heads: [heads_per_rank, 1, sk] = slope * key position."""

    def __init__(self, cfg: ModelConfig, tp_rank: int, tp_size: int):
        super().__init__()
        per_rank = cfg.num_attention_heads // tp_size
        slopes = alibi_slopes(cfg.num_attention_heads)[tp_rank * per_rank:(tp_rank + 1) * per_rank]
        self.register_buffer("slopes", slopes, persistent=False)

    def forward(self, sk: int, dtype, device) -> torch.Tensor:
        keys = torch.arange(sk, dtype=torch.float32, device=device)
        return (self.slopes.to(device)[:, None, None] * keys).to(dtype)


# fairseq numbers positions from padding_idx + 1; its dictionaries' padding index is 1.
SINUSOIDAL_OFFSET = 2


def sinusoidal_table(num_positions: int, dim: int, offset: int = SINUSOIDAL_OFFSET) -> torch.Tensor:
    """fairseq's sinusoidal position embeddings [num_positions, dim] (float32) of positions
    offset .. offset + num_positions - 1: [sin | cos] halves of position * exp(-i ln(10000) /
    (dim / 2 - 1)), i < dim / 2, and a zero column when dim is odd."""
    half = dim // 2
    step = math.log(10000) / (half - 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.float32) * -step)
    table = torch.arange(offset + num_positions, dtype=torch.float32).unsqueeze(1) * freqs
    table = torch.cat([torch.sin(table), torch.cos(table)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(table.shape[0], 1)], dim=1)
    return table[offset:]
