"""FLOPs of one GPT training iteration, throughput, and the device's matmul rate.

Counts are multiply-adds x 2 of the matrix products (elementwise work, norms and
softmax are left out, as in Megatron-LM). Attention scores and context count the
full s x s square (Megatron-LM's convention), also for causal attention.

- model FLOPs: forward + backward = 3 x the forward (the backward computes the
  gradients of both the inputs and the weights of every product);
- hardware FLOPs: the model FLOPs plus what recomputation repeats in backward:
  one more forward of the transformer layers (`full`) or of the attention core
  (`selective`). MFU uses the model FLOPs.
"""
import time
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

FORWARD_AND_BACKWARD = 3


@dataclass
class LayerFlops:
    """Forward FLOPs of one transformer layer over `tokens` tokens."""
    qkv: float
    scores: float
    context: float
    dense: float
    mlp: float

    @property
    def total(self) -> float:
        return self.qkv + self.scores + self.context + self.dense + self.mlp


def mlp_forward_flops(cfg, tokens: int, moe_layer: bool = False) -> float:
    """The MLP's forward: dense, or an MoE layer's router and its activated experts (top-k
    experts of --moe-ffn-hidden-size each, plus the shared expert) per token."""
    matmuls = 3 if cfg.gated_mlp else 2  # gate, up, down
    if not moe_layer:
        return 2.0 * tokens * cfg.hidden_size * cfg.ffn_hidden_size * matmuls
    moe = cfg.moe
    width = ((moe.moe_ffn_hidden_size or cfg.ffn_hidden_size) * moe.moe_router_topk
             + (moe.moe_shared_expert_intermediate_size or 0))
    return 2.0 * tokens * cfg.hidden_size * (width * matmuls + moe.num_experts)


def num_moe_layers(cfg) -> int:
    moe = cfg.moe
    return sum(moe.layer_pattern(cfg.num_layers)) if moe is not None and moe.enabled else 0


def _layers_total(cfg, tokens: int, part) -> float:
    """sum over the layers of part(LayerFlops), dense and MoE layers each counted."""
    moe = num_moe_layers(cfg)
    total = (cfg.num_layers - moe) * part(layer_forward_flops(cfg, tokens))
    if moe:
        total += moe * part(layer_forward_flops(cfg, tokens, moe_layer=True))
    return total


def mla_forward_flops(cfg, tokens: int, moe_layer: bool = False) -> LayerFlops:
    """One multi-latent attention layer's forward: the down- and up-projections of the
    query (or its direct projection) and of the latent, scores over q / k heads of
    qk_head_dim + qk_pos_emb_head_dim, the context and output over v_head_dim."""
    h, s, n = cfg.hidden_size, cfg.seq_length, cfg.num_attention_heads
    qk, v = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim, cfg.v_head_dim
    q = h * n * qk if cfg.q_lora_rank is None else cfg.q_lora_rank * (h + n * qk)
    kv = h * (cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim) + cfg.kv_lora_rank * n * (cfg.qk_head_dim + v)
    return LayerFlops(qkv=2.0 * tokens * (q + kv), scores=2.0 * tokens * s * n * qk,
                      context=2.0 * tokens * s * n * v, dense=2.0 * tokens * n * v * h,
                      mlp=mlp_forward_flops(cfg, tokens, moe_layer))


def layer_forward_flops(cfg, tokens: int, moe_layer: bool = False) -> LayerFlops:
    """One layer's forward over `tokens` = batch x seq tokens (sequences of cfg.seq_length)."""
    if cfg.multi_latent_attention:
        return mla_forward_flops(cfg, tokens, moe_layer)
    h, s = cfg.hidden_size, cfg.seq_length
    q_size = cfg.num_attention_heads * cfg.kv_channels
    kv_size = cfg.num_query_groups * cfg.kv_channels
    return LayerFlops(qkv=2.0 * tokens * h * (q_size + 2 * kv_size),
                      scores=2.0 * tokens * s * q_size,
                      context=2.0 * tokens * s * q_size,
                      dense=2.0 * tokens * q_size * h,
                      mlp=mlp_forward_flops(cfg, tokens, moe_layer))


def logits_forward_flops(cfg, tokens: int) -> float:
    return 2.0 * tokens * cfg.hidden_size * cfg.padded_vocab_size


def model_flops(cfg, batch_size: int) -> float:
    """Model FLOPs of one iteration over `batch_size` sequences (forward and backward)."""
    tokens = batch_size * cfg.seq_length
    forward = _layers_total(cfg, tokens, lambda f: f.total) + logits_forward_flops(cfg, tokens)
    return FORWARD_AND_BACKWARD * forward


def recompute_flops(cfg, batch_size: int) -> float:
    """Forward FLOPs that activation recomputation repeats in one iteration."""
    tokens = batch_size * cfg.seq_length
    if cfg.recompute_granularity == "full":
        return _layers_total(cfg, tokens, lambda f: f.total)
    if cfg.recompute_granularity == "selective":
        return _layers_total(cfg, tokens, lambda f: f.scores + f.context)
    return 0.0


def hardware_flops(cfg, batch_size: int) -> float:
    return model_flops(cfg, batch_size) + recompute_flops(cfg, batch_size)


def device_name(device: torch.device) -> str:
    """What one process runs on, as the log line names it: 'GPU' (Megatron's word) or 'CPU process'."""
    return "GPU" if torch.device(device).type == "cuda" else "CPU process"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(device, dtype: torch.dtype, shape: Optional[Tuple[int, int, int]] = None,
                seconds: float = 0.25) -> float:
    """FLOP/s of an [m, k] x [k, n] matmul on `device` in `dtype`, the best of
    repeated runs within about `seconds`. Default shape: square, 1024 on CPUs, 8192 on GPUs."""
    device = torch.device(device)
    side = 8192 if device.type == "cuda" else 1024
    m, k, n = shape or (side, side, side)
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    torch.matmul(a, b)  # warm-up
    _sync(device)
    best, deadline = float("inf"), time.perf_counter() + seconds
    for _ in range(50):
        start = time.perf_counter()
        torch.matmul(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() > deadline:
            break
    return 2.0 * m * k * n / best


def throughput(flops_per_iteration: float, seconds_per_iteration: float, world_size: int,
               tokens_per_iteration: int, peak_flops_per_device: Optional[float]) -> Dict[str, float]:
    """TFLOP/s per device, tokens/s over all devices and MFU (a fraction) for one iteration time."""
    per_device = flops_per_iteration / (seconds_per_iteration * world_size)
    out = {"tflops": per_device / 1e12, "tokens_per_second": tokens_per_iteration / seconds_per_iteration}
    if peak_flops_per_device:
        out["mfu"] = per_device / peak_flops_per_device
    return out


def format_throughput(values: Dict[str, float], device: torch.device) -> str:
    """The log line's throughput fields, Megatron-LM's wording on GPUs."""
    name = device_name(device)
    unit = "GPU" if name == "GPU" else "CPU"
    line = f" throughput per {name} (TFLOP/s/{unit}): {values['tflops']:.4g} |"
    line += f" tokens per second: {values['tokens_per_second']:.1f} |"
    if "mfu" in values:
        line += f" MFU: {100.0 * values['mfu']:.2f}% |"
    return line


class ThroughputMeter:
    """--log-throughput: the log line's throughput fields and their TensorBoard scalars."""

    def __init__(self, model_cfg, device, dtype: torch.dtype, world_size: int,
                 peak_tflops: Optional[float] = None):
        self.cfg, self.device, self.world_size = model_cfg, torch.device(device), world_size
        self.probed = peak_tflops is None
        self.peak = matmul_rate(self.device, dtype) if self.probed else peak_tflops * 1e12

    def describe(self) -> str:
        source = "matmul probe" if self.probed else "--peak-flops"
        return (f" > MFU against {self.peak / 1e12:.4g} TFLOP/s per "
                f"{device_name(self.device)} ({source})")

    def measure(self, batch_size: int, seconds_per_iteration: float) -> Dict[str, float]:
        return throughput(model_flops(self.cfg, batch_size), seconds_per_iteration, self.world_size,
                          batch_size * self.cfg.seq_length, self.peak)

    def log_fields(self, batch_size: int, seconds_per_iteration: float):
        """(text for the log line, TensorBoard scalars)."""
        values = self.measure(batch_size, seconds_per_iteration)
        scalars = {"throughput": values["tflops"], "tokens-per-second": values["tokens_per_second"],
                   "mfu": values["mfu"]}
        return format_throughput(values, self.device), scalars
