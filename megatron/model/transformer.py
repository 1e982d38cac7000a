"""Pre-layer-norm transformer built from tensor-parallel layers: the MLP, the layer (its
attention from megatron/model/attention.py or megatron/model/mla.py) and the layers of one
pipeline chunk.

Activations are [s, b, h] (sequence first, as Megatron), or [s / TP, b, h]
between tensor-parallel regions under sequence parallelism.
"""
import contextlib

import torch

from megatron.config import ModelConfig
from megatron import fused
from megatron.model.attention import ParallelAttention
from megatron.model.mla import MLASelfAttention
from megatron.model.spec import make_norm, make_post_norm, mlp_activation
from megatron.model.moe.layer import MoELayer
from megatron.model.moe.router import TopKRouter
from megatron.mpu.parallel_state import ExpertGroups
from megatron.mpu import checkpoint, get_rng_tracker
from megatron.mpu.layers import ColumnParallelLinear, RowParallelLinear, init_normal, \
    scaled_init_normal


def dropout_rng_context(sequence_parallel: bool):
    """Activations split across TP ranks need per-rank dropout masks."""
    return get_rng_tracker().fork() if sequence_parallel else contextlib.nullcontext()


def enable_context_parallel(model: torch.nn.Module, group, comm_type: str = "p2p") -> None:
    """Make every attention module of `model` attend across the CP `group` (its inputs
    are then this rank's two sequence chunks, megatron.model.context_parallel), and every
    MoE router count its auxiliary losses over the whole sequences."""
    for module in model.modules():
        if isinstance(module, ParallelAttention):
            module.cp_group, module.cp_comm_type = group, comm_type
        elif isinstance(module, TopKRouter) or getattr(module, "follows_context_parallel", False):
            module.cp_group = group  # routers, the MTP block (megatron/model/mtp.py)


def attention_class(cfg: ModelConfig):
    """The self-attention module of `cfg`: multi-latent attention (megatron/model/mla.py,
    --multi-latent-attention) or ParallelAttention."""
    if cfg.multi_latent_attention:
        return MLASelfAttention
    return ParallelAttention


class ParallelMLP(torch.nn.Module):
    """h -> ffn (column parallel) -> activation -> h (row parallel).

    Gated activations double the first layer's rows: [gate; up] in the single-process
    weight, [gate_r; up_r] on TP rank r (partition stride / sharding groups 2).
    """

    def __init__(self, cfg: ModelConfig, tp_group, device, dtype):
        super().__init__()
        self.cfg = cfg
        common = dict(tp_group=tp_group, sequence_parallel=cfg.sequence_parallel, skip_bias_add=True,
                      bias=cfg.add_bias_linear, device=device, dtype=dtype)
        gates = 2 if cfg.gated_mlp else 1
        self.dense_h_to_4h = ColumnParallelLinear(
            cfg.hidden_size, gates * cfg.ffn_hidden_size, stride=gates,
            init_method=init_normal(cfg.init_method_std), **common)
        self.activation = mlp_activation(cfg)
        self.dense_4h_to_h = RowParallelLinear(
            cfg.ffn_hidden_size, cfg.hidden_size, input_is_parallel=True,
            init_method=scaled_init_normal(cfg.init_method_std, cfg.num_layers), **common)

    def forward(self, hidden):
        x, bias = self.dense_h_to_4h(hidden)
        return self.dense_4h_to_h(self.activation(x, bias))


class ParallelTransformerLayer(torch.nn.Module):
    """x + Attn(LN(x)), then + MLP(LN(.)); dropout on each branch output. With
    --sandwich-norm each branch output is normalised too (x + LN(Attn(LN(x))), Gemma 3's)."""

    def __init__(self, cfg: ModelConfig, layer_number: int, tp_group, device, dtype,
                 expert_groups=None):
        super().__init__()
        self.cfg = cfg
        self.layer_number = layer_number
        self.input_layernorm = make_norm(cfg, device, dtype)
        self.self_attention = attention_class(cfg)(cfg, layer_number, tp_group, device, dtype)
        self.post_self_attention_layernorm = make_post_norm(cfg, device, dtype)
        self.post_attention_layernorm = make_norm(cfg, device, dtype)
        if cfg.is_moe_layer(layer_number):
            groups = expert_groups or ExpertGroups(tp_group=tp_group)
            self.mlp = MoELayer(cfg, layer_number, groups, device, dtype)
        else:
            self.mlp = ParallelMLP(cfg, tp_group, device, dtype)
        self.post_mlp_layernorm = make_post_norm(cfg, device, dtype)

    def _residual(self, out_and_bias, residual, post_norm=None):
        out, bias = out_and_bias
        if post_norm is not None:
            out, bias = post_norm(out if bias is None else out + bias), None
        with dropout_rng_context(self.cfg.sequence_parallel):
            return fused.bias_dropout_add(out, bias, residual, self.cfg.hidden_dropout,
                                          self.training, fusion=self.cfg.bias_dropout_fusion)

    def forward(self, hidden, mask=None, inference_params=None):
        attention = self.self_attention(self.input_layernorm(hidden), mask, inference_params)
        hidden = self._residual(attention, hidden, self.post_self_attention_layernorm)
        return self._residual(self.mlp(self.post_attention_layernorm(hidden)), hidden,
                              self.post_mlp_layernorm)


class ParallelTransformer(torch.nn.Module):
    """The layers of one pipeline chunk, plus the final layer norm on the last one.

    `layer_offset` is the global index of the first local layer; layers are named
    by their local index (as in Megatron's checkpoints) but know their global number.
    """

    def __init__(self, cfg: ModelConfig, tp_group, layer_offset: int, num_local_layers: int,
                 post_process: bool, device=None, dtype=torch.float32, expert_groups=None):
        super().__init__()
        self.cfg = cfg
        self.layer_offset = layer_offset
        self.layers = torch.nn.ModuleList(
            ParallelTransformerLayer(cfg, layer_offset + i + 1, tp_group, device, dtype,
                                     expert_groups)
            for i in range(num_local_layers))
        self.final_layernorm = make_norm(cfg, device, dtype) if post_process else None

    def _run(self, start, end, inference_params=None):
        def run(hidden, mask):
            for layer in self.layers[start:end]:
                hidden = layer(hidden, mask, inference_params)
            return hidden
        return run

    def forward(self, hidden, mask=None, inference_params=None):
        if self.cfg.recompute_granularity == "full" and self.training:
            n = self.cfg.checkpoint_num_layers
            if self.cfg.recompute_method == "block":  # recompute the first n layers only
                for i in range(len(self.layers)):
                    run = self._run(i, i + 1)
                    hidden = checkpoint(run, hidden, mask) if i < n else run(hidden, mask)
            else:  # uniform: every chunk of n layers
                for start in range(0, len(self.layers), n):
                    hidden = checkpoint(self._run(start, start + n), hidden, mask)
        else:
            hidden = self._run(0, len(self.layers), inference_params)(hidden, mask)
        if self.final_layernorm is not None:
            hidden = self.final_layernorm(hidden)
        elif not self.layers:  # an empty pipeline chunk passes its input on as a view: a
            hidden = hidden.view_as(hidden)  # new tensor, so freeing it once sent frees
        return hidden  # nothing the backward needs, and the backward reaches the input
