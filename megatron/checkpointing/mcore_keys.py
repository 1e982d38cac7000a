"""Megatron-Core's state-dict keys for our parameter names (GPT, local layer spec).

Megatron-Core's `sharded_state_dict` of a GPT model names every layer's tensor once,
stacked along a leading layer axis (`decoder.layers.<name>` of shape [num_layers, ...]),
and its local spec stores each layer norm inside the linear that follows it, under
Transformer Engine's names:

    language_model.embedding.word_embeddings.weight      embedding.word_embeddings.weight
    language_model.embedding.position_embeddings.weight  embedding.position_embeddings.weight
    ...layers.N.input_layernorm.X                        decoder.layers.self_attention.linear_qkv.layer_norm_X
    ...layers.N.self_attention.query_key_value.X         decoder.layers.self_attention.linear_qkv.X
    ...layers.N.self_attention.dense.X                   decoder.layers.self_attention.linear_proj.X
    ...layers.N.post_attention_layernorm.X               decoder.layers.mlp.linear_fc1.layer_norm_X
    ...layers.N.mlp.dense_h_to_4h.X                      decoder.layers.mlp.linear_fc1.X
    ...layers.N.mlp.dense_4h_to_h.X                      decoder.layers.mlp.linear_fc2.X
    language_model.encoder.final_layernorm.X             decoder.final_layernorm.X
    language_model.output_layer.weight                   output_layer.weight

With dense and MoE layers mixed (--moe-layer-freq a list or above 1) Megatron-Core keys each
layer on its own, `decoder.layers.<g>.self_attention.linear_qkv.weight` without the layer
axis (`stacks_layers`), as its TransformerBlock.sharded_state_dict does.

MoE layers: `mlp.router.weight` [L, E, h], and the persistent buffer `mlp.router.expert_bias`
[L, E] (float32) under the same name, as Megatron-Core's TopKRouter state dict has it; the
stacked experts `mlp.experts.linear_fc1.X` are Megatron-Core's
`decoder.layers.mlp.experts.experts.linear_fc1.X` of shape [L, E, ...]: the key and layout
that its SequentialMLP, GroupedMLP and TEGroupedMLP share, the global expert index being
the offset along the axis after the layer axis; `shared_experts` keep their names.

Multi-latent attention (megatron/model/mla.py; --multi-latent-attention) keeps its
projection and norm names, which are Megatron-Core's: `self_attention.{linear_q_down_proj,
q_layernorm, linear_q_up_proj}` (`linear_q_proj` without --q-lora-rank), `self_attention.
{linear_kv_down_proj, kv_layernorm, linear_kv_up_proj}`, `dense` -> `linear_proj`. Its local
spec (get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True)) has no
key map, so the layer norms are `input_layernorm.X` and `pre_mlp_layernorm.X` (`mla`; with
Transformer Engine Megatron-LM fuses the q / kv norms into `linear_q_up_proj.layer_norm_
weight` / `linear_kv_up_proj.layer_norm_weight` instead, which we do not read). Global
shapes are the same in both; Megatron-Core's local spec splits the down-projections over
TP on dim 0 (ColumnParallelLinear, gather_output=False) where ours replicates them, which
the torch_dist regions re-slice like any other re-sharding.

MTP depths (megatron/model/mtp.py) keep their names, `mtp.layers.K.{enorm,hnorm,eh_proj,
final_layernorm}.X`, each unstacked, and their transformer layer is renamed as a decoder
layer is: `mtp.layers.K.transformer_layer.self_attention.linear_qkv.X`, as Megatron-Core's
MultiTokenPredictionBlock.sharded_state_dict names them.

The fused QKV rows (query groups of [q heads, k, v]) and the gated MLP's [gate; up] rows
are the same in both. A name Megatron-Core lacks (e.g. BLOOM's embedding layer norm) keeps
its place under the same prefix (`embedding.word_embeddings.norm.weight`). The optimizer
state of a parameter with key K is `optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.K`.
"""
import re
from typing import Optional, Tuple

_LAYER = re.compile(r"^language_model\.encoder\.layers\.(\d+)\.(.+)$")
_MTP_LAYER = re.compile(r"^(mtp\.layers\.\d+\.transformer_layer\.)(.+)$")
_IN_LAYER = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
             ("self_attention.query_key_value.", "self_attention.linear_qkv."),
             ("self_attention.dense.", "self_attention.linear_proj."),
             ("post_attention_layernorm.", "mlp.linear_fc1.layer_norm_"),
             ("mlp.dense_h_to_4h.", "mlp.linear_fc1."),
             ("mlp.dense_4h_to_h.", "mlp.linear_fc2."),
             ("mlp.experts.", "mlp.experts.experts."))
_TOP = (("language_model.embedding.", "embedding."),
        ("language_model.encoder.final_layernorm.", "decoder.final_layernorm."),
        ("language_model.output_layer.", "output_layer."),
        ("language_model.encoder.", "decoder."))
_MLA_NORMS = (("input_layernorm.", "input_layernorm."),
              ("post_attention_layernorm.", "pre_mlp_layernorm."))
OPTIMIZER_PREFIX = "optimizer.state"


def _rename(name: str, table) -> Optional[str]:
    for ours, theirs in table:
        if name.startswith(ours):
            return theirs + name[len(ours):]
    return None


def stacks_layers(cfg) -> bool:
    """Whether Megatron-Core stacks this model's layers along a leading axis. Its
    TransformerBlock does not when --moe-layer-freq is a list or an int above 1 (dense and
    MoE layers mixed): each layer's tensors are then keyed `decoder.layers.<g>.<name>`, g
    the global layer index, with no layer axis."""
    freq = cfg.moe.moe_layer_freq if cfg.moe is not None else 1
    return isinstance(freq, int) and freq <= 1


def mcore_key(global_name: str, stacked: bool = True,
              mla: bool = False) -> Tuple[str, Optional[int]]:
    """(Megatron-Core key, global layer index along the stacked axis or None) of a parameter
    named with global layer numbers (GPTModel.global_parameter_names); `stacked` False
    (stacks_layers) puts the layer index in the key instead; `mla` (cfg.multi_latent_attention)
    keeps the layer norms unfused, as Megatron-Core's MLA local spec names them."""
    table = _MLA_NORMS + _IN_LAYER if mla else _IN_LAYER
    match = _MTP_LAYER.match(global_name)
    if match:  # Megatron-Core keys each MTP layer on its own, never stacked
        return match.group(1) + (_rename(match.group(2), table) or match.group(2)), None
    if global_name.startswith("mtp.layers."):
        return global_name, None
    match = _LAYER.match(global_name)
    if match:
        inner = _rename(match.group(2), table) or match.group(2)
        if not stacked:
            return f"decoder.layers.{match.group(1)}.{inner}", None
        return "decoder.layers." + inner, int(match.group(1))
    key = _rename(global_name, _TOP)
    if key is None:
        raise KeyError(f"parameter {global_name!r} has no Megatron-Core key")
    return key, None


def optimizer_key(state_name: str, key: str) -> str:
    """Key of one optimizer tensor (fp32_param, exp_avg, exp_avg_sq) of parameter `key`."""
    return f"{OPTIMIZER_PREFIX}.{state_name}.{key}"
