"""DeepSeek-V3 (DeepseekV3ForCausalLM; also Kimi-K2 and Moonlight) <-> our GPT with
multi-latent attention, DeepSeek routing and multi-token prediction.

Attention: q_proj (no q_lora_rank) or q_a_proj / q_a_layernorm / q_b_proj, then
kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj and o_proj are our linear_q_proj or
linear_q_down_proj / q_layernorm / linear_q_up_proj, linear_kv_down_proj / kv_layernorm /
linear_kv_up_proj and dense (row layouts equal). RoPE: with rope_interleave (DeepSeek's
weights) HF rotates the pe channels as pairs (x0, x1), (x2, x3)..., which is ours (MLA
takes them even-first before its rotate-half); without it HF rotates them half-split, so
their rows are interleaved on import (de-interleaved on export). The softmax scale is
DeepSeek's: 1/sqrt(qk head size) times mscale(factor, mscale_all_dim)^2 under YaRN.

MLP: the first first_k_dense_replace layers are dense gated MLPs (intermediate_size), the
others MoE (our --moe-layer-freq list): sigmoid scores, e_score_correction_bias as our
expert bias, n_group / topk_group group-limited top-k (a group scores the sum of its best
2), the top-k renormalised (norm_topk_prob) and scaled by routed_scaling_factor, plus the
n_shared_experts shared experts as one of moe_intermediate_size x n_shared_experts.

MTP (num_nextn_predict_layers): DeepSeek's layer index num_hidden_layers + k with enorm,
hnorm, eh_proj, shared_head.norm (our mtp.layers.k.final_layernorm), a decoder layer, and
copies of the embedding and head (embed_tokens, shared_head.head: ours shares the main
ones). A checkpoint without those tensors (transformers' save_pretrained) converts
without MTP, its config then saying num_nextn_predict_layers 0. FP8 (e4m3) weights with
128 x 128 block scales (weight_scale_inv) are dequantized on import (`dequantized`).
"""
import math

import torch

from megatron.checkpointing.hf import common as c
from megatron.checkpointing.hf import llama
from megatron.checkpointing.hf import mixtral as moe_map
from megatron.config import MoEConfig

ARCHITECTURES = ("DeepseekV3ForCausalLM",)
P = llama.P
NAMES = ("mlp.", "gate_proj", "up_proj", "down_proj")
BLOCK = 128  # DeepSeek's FP8 weight block (weight_block_size)
_ATTENTION = (("q_proj", "linear_q_proj"), ("q_a_proj", "linear_q_down_proj"),
              ("q_a_layernorm", "q_layernorm"), ("q_b_proj", "linear_q_up_proj"),
              ("kv_a_proj_with_mqa", "linear_kv_down_proj"), ("kv_a_layernorm", "kv_layernorm"),
              ("kv_b_proj", "linear_kv_up_proj"), ("o_proj", "dense"))


# -- config ------------------------------------------------------------------------------
def _mtp_depths(hf: dict) -> int:
    return int(c.setting(hf, "num_nextn_predict_layers", "num_mtp_layers", default=0))


def _routing(hf: dict) -> dict:
    """Our router fields of DeepSeek's routing (one-line errors where ours differs)."""
    k, groups = hf["num_experts_per_tok"], hf.get("n_group") or 1
    topk_group = hf.get("topk_group") or 1
    norm = bool(hf.get("norm_topk_prob", True))
    c.refuse(norm != (k > 1), f"norm_topk_prob={norm} with num_experts_per_tok={k} is not "
                              f"supported (our sigmoid router renormalises the top-k iff k > 1)")
    grouped = groups > 1 and topk_group < groups
    c.refuse(grouped and k != 2 * topk_group,
             f"num_experts_per_tok={k} with topk_group={topk_group}: DeepSeek scores a group by "
             f"its best 2 experts, ours by its best k / topk_group; use k = 2 x topk_group")
    return dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_num_groups=groups if grouped else None,
                moe_router_group_topk=topk_group if grouped else None,
                moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0))


def _moe(hf: dict) -> MoEConfig:
    layers, dense = hf["num_hidden_layers"], hf.get("first_k_dense_replace") or 0
    shared = (hf.get("n_shared_experts") or 0) * hf["moe_intermediate_size"]
    return MoEConfig(num_experts=c.setting(hf, "n_routed_experts", "num_local_experts"),
                     moe_router_topk=hf["num_experts_per_tok"],
                     moe_ffn_hidden_size=hf["moe_intermediate_size"],
                     moe_layer_freq=[int(i >= dense) for i in range(layers)],
                     moe_shared_expert_intermediate_size=shared or None,
                     moe_aux_loss_coeff=float(hf.get("aux_loss_alpha") or 0.0), **_routing(hf))


def _rope_fields(hf: dict) -> dict:
    fields = llama._rope(hf)
    params = llama._rope_parameters(hf)
    kind = params.get("rope_type", params.get("type", "default"))
    c.refuse(kind not in ("default", "yarn"), f"rope scaling {kind!r} is not supported for "
                                              f"DeepseekV3 (supported: default, yarn)")
    if kind == "yarn":
        fields.update(mscale=float(params.get("mscale") or 1.0),
                      mscale_all_dim=float(params.get("mscale_all_dim") or 0.0))
    return fields


def model_fields(hf: dict, seq_length=None) -> dict:
    act = hf.get("hidden_act", "silu")
    c.refuse(act != "silu", f"hidden_act {act!r} is not supported (only silu: SwiGLU)")
    c.refuse(bool(hf.get("attention_bias", False)),
             "attention_bias=True is not supported (our MLA projections have no biases)")
    positions, heads = hf["max_position_embeddings"], hf["num_attention_heads"]
    fields = dict(num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
                  num_attention_heads=heads, kv_channels=hf["v_head_dim"],
                  ffn_hidden_size=hf["intermediate_size"], max_position_embeddings=positions,
                  seq_length=c.sequence_length(seq_length, positions),
                  position_embedding_type="rope", normalization="RMSNorm",
                  layernorm_epsilon=hf.get("rms_norm_eps", 1e-6), activation="swiglu",
                  hidden_dropout=0.0, attention_dropout=float(hf.get("attention_dropout", 0.0)),
                  untie_embeddings_and_output_weights=c.untied(hf), add_bias_linear=False,
                  multi_latent_attention=True, q_lora_rank=hf.get("q_lora_rank"),
                  kv_lora_rank=hf["kv_lora_rank"], qk_head_dim=hf["qk_nope_head_dim"],
                  qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
                  mtp_num_layers=_mtp_depths(hf) or None, **_rope_fields(hf))
    dense = hf.get("first_k_dense_replace") or 0
    if c.setting(hf, "n_routed_experts", "num_local_experts") and dense < hf["num_hidden_layers"]:
        fields["moe"] = _moe(hf)
    return fields


# -- FP8 weights and the files' MTP layers ------------------------------------------------
def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, dtype) -> torch.Tensor:
    """weight (float8) x its per-128x128-block scale (edge blocks partial) in `dtype`."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return (weight.float() * scale[:rows, :cols]).to(dtype)


def dequantized(sd: c.StateDict) -> c.StateDict:
    """The state dict with every `X.weight` that has an `X.weight_scale_inv` dequantized."""
    scales = {name[:-len("_scale_inv")] for name in sd if name.endswith(".weight_scale_inv")}
    if not scales:
        return sd
    plain = [t.dtype for n, t in sd.items() if t.is_floating_point() and n not in scales and
             t.element_size() > 1 and not n.endswith("_scale_inv")]
    dtype = plain[0] if plain else torch.bfloat16
    return {name: dequantize(t, sd[name + "_scale_inv"], dtype) if name in scales else t
            for name, t in sd.items() if not name.endswith(".weight_scale_inv")}


def prepare(hf: dict, sd: c.StateDict):
    """(config, weights) as converted: FP8 weights dequantized (the quantization_config
    dropped), num_nextn_predict_layers 0 when the file holds no MTP layer."""
    hf = {k: v for k, v in hf.items() if k != "quantization_config"}
    first = f"{P}{hf['num_hidden_layers']}.eh_proj.weight"
    if _mtp_depths(hf) and first not in sd:
        hf["num_nextn_predict_layers"] = 0
        hf.pop("num_mtp_layers", None)
    return hf, dequantized(sd)


# -- tensors -----------------------------------------------------------------------------
def _interleave(t: torch.Tensor) -> torch.Tensor:
    """Rows [a0..a(d/2-1), b0..] -> [a0, b0, a1, b1, ...] (the inverse of mla.deinterleave)."""
    half = t.shape[0] // 2
    return torch.stack((t[:half], t[half:]), dim=1).reshape(t.shape)


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    return torch.cat((t[0::2], t[1::2]))


def _pe_rows(weight: torch.Tensor, head: int, pe: int, permute) -> torch.Tensor:
    """`permute` applied to the last `pe` rows of each `head`-row block of `weight`."""
    blocks = weight.view(-1, head, *weight.shape[1:])
    nope, rot = blocks[:, :head - pe], blocks[:, head - pe:]
    rot = torch.stack([permute(r) for r in rot])
    return torch.cat((nope, rot), dim=1).reshape(weight.shape).contiguous()


def _rope_layout(hf: dict, name: str, weight: torch.Tensor, cfg, permute) -> torch.Tensor:
    """The q / kv down-projection's pe rows (HF `name`) in the other convention
    (rope_interleave off)."""
    if hf.get("rope_interleave", True):
        return weight
    pe = cfg.qk_pos_emb_head_dim
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
        return _pe_rows(weight, cfg.qk_head_dim + pe, pe, permute)
    if name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
        return _pe_rows(weight, weight.shape[0], pe, permute)
    return weight


def _tensor_names(theirs: str, ours: str, cfg, number: int):
    """(HF name, our name) of a decoder layer's norms, attention and expert bias."""
    for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        yield theirs + norm, ours + norm
    for hf_name, our_name in _ATTENTION:
        if (hf_name == "q_proj") == (cfg.q_lora_rank is None) or hf_name.startswith(("kv", "o")):
            yield f"{theirs}self_attn.{hf_name}.weight", f"{ours}self_attention.{our_name}.weight"
    if cfg.is_moe_layer(number):
        yield theirs + "mlp.gate.e_score_correction_bias", ours + "mlp.router.expert_bias"


def _mlp(functions, sd, src, dst, cfg, number, out) -> None:
    """A dense layer's MLP, or a MoE layer's experts and shared experts, one way."""
    dense, experts = functions
    if not cfg.is_moe_layer(number):
        dense(sd, src, dst, "mlp.", out)
        return
    experts(sd, src, dst, cfg, NAMES, out)
    if cfg.moe.moe_shared_expert_intermediate_size:
        dense(sd, src, dst, "mlp.shared_experts.", out, ours="mlp.shared_experts.")


def _layer_to_megatron(sd, hf, src, dst, cfg, number, out) -> None:
    for theirs, ours in _tensor_names(src, dst, cfg, number):
        out[ours] = _rope_layout(hf, theirs, c.take(sd, theirs), cfg, _interleave)
    _mlp((moe_map.dense_mlp_to_megatron, moe_map.experts_to_megatron), sd, src, dst, cfg,
         number, out)


def _layer_to_hf(flat, hf, src, dst, cfg, number, out) -> None:
    for theirs, ours in _tensor_names(dst, src, cfg, number):
        out[theirs] = _rope_layout(hf, theirs, c.take(flat, ours), cfg, _deinterleave)
    _mlp((moe_map.dense_mlp_to_hf, moe_map.experts_to_hf), flat, src, dst, cfg, number, out)


_MTP_NORMS = (("enorm.", "enorm."), ("hnorm.", "hnorm."), ("shared_head.norm.", "final_layernorm."))


def _refuse_own_copies(sd, hf, src: str) -> None:
    """The MTP layer's embed_tokens / shared_head.head must be the model's (ours shares them)."""
    head = "lm_head.weight" if c.untied(hf) else "model.embed_tokens.weight"
    for name, main in (("embed_tokens.weight", "model.embed_tokens.weight"),
                       ("shared_head.head.weight", head)):
        c.refuse(src + name in sd and not torch.equal(sd[src + name], c.take(sd, main)),
                 f"{src}{name} differs from {main}: our MTP shares the model's embedding and "
                 f"head, so it cannot carry its own")


def _mtp_to_megatron(sd, hf, cfg, out) -> None:
    for k in range(cfg.mtp_depths):
        src, dst = f"{P}{cfg.num_layers + k}.", f"mtp.layers.{k}."
        for theirs, ours in _MTP_NORMS:
            c.pair_to_megatron(sd, src + theirs, dst + ours, out, bias=False)
        out[dst + "eh_proj.weight"] = c.take(sd, src + "eh_proj.weight")
        _refuse_own_copies(sd, hf, src)
        _layer_to_megatron(sd, hf, src, dst + "transformer_layer.", cfg,
                           cfg.num_layers + k + 1, out)


def _mtp_to_hf(flat, hf, cfg, out) -> None:
    for k in range(cfg.mtp_depths):
        src, dst = f"mtp.layers.{k}.", f"{P}{cfg.num_layers + k}."
        for theirs, ours in _MTP_NORMS:
            c.pair_to_hf(flat, src + ours, dst + theirs, out, bias=False)
        out[dst + "eh_proj.weight"] = c.take(flat, src + "eh_proj.weight")
        out[dst + "embed_tokens.weight"] = out["model.embed_tokens.weight"]
        out[dst + "shared_head.head.weight"] = out.get("lm_head.weight",
                                                       out["model.embed_tokens.weight"])
        _layer_to_hf(flat, hf, src + "transformer_layer.", dst, cfg, cfg.num_layers + k + 1, out)


def to_megatron(sd: c.StateDict, hf: dict, cfg) -> c.StateDict:
    sd = dequantized(sd)
    out = {c.WORD: c.take(sd, "model.embed_tokens.weight")}
    for i in range(cfg.num_layers):
        _layer_to_megatron(sd, hf, f"{P}{i}.", c.layer(i), cfg, i + 1, out)
    c.pair_to_megatron(sd, "model.norm.", c.FINAL_NORM, out, bias=False)
    c.head_to_megatron(sd, hf, out)
    _mtp_to_megatron(sd, hf, cfg, out)
    return out


def to_hf(flat: c.StateDict, hf: dict, cfg) -> c.StateDict:
    out = {"model.embed_tokens.weight": c.take(flat, c.WORD)}
    for i in range(cfg.num_layers):
        _layer_to_hf(flat, hf, c.layer(i), f"{P}{i}.", cfg, i + 1, out)
    c.pair_to_hf(flat, c.FINAL_NORM, "model.norm.", out, bias=False)
    c.head_to_hf(flat, hf, out)
    _mtp_to_hf(flat, hf, cfg, out)
    return out


def hf_config(cfg, vocab: int) -> dict:
    """The DeepseekV3Config of an MLA model of ours (checked against `model_fields`)."""
    hf = llama.hf_config(cfg, vocab)
    for key in ("attention_bias", "mlp_bias", "head_dim"):
        hf.pop(key, None)
    hf.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
              q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
              qk_nope_head_dim=cfg.qk_head_dim, qk_rope_head_dim=cfg.qk_pos_emb_head_dim,
              v_head_dim=cfg.v_head_dim, rope_interleave=True, attention_bias=False,
              num_nextn_predict_layers=cfg.mtp_depths, first_k_dense_replace=cfg.num_layers)
    if "rope_scaling" in hf:
        hf["rope_scaling"].update(mscale=cfg.mscale, mscale_all_dim=cfg.mscale_all_dim)
    moe = cfg.moe
    if moe is not None and moe.enabled:
        dense = [n for n in range(1, cfg.num_layers + 1) if not cfg.is_moe_layer(n)]
        shared = moe.moe_shared_expert_intermediate_size or 0
        width = moe.moe_ffn_hidden_size or cfg.ffn_hidden_size
        hf.update(first_k_dense_replace=len(dense), n_routed_experts=moe.num_experts,
                  num_experts_per_tok=moe.moe_router_topk, moe_intermediate_size=width,
                  n_shared_experts=shared // width,
                  n_group=moe.moe_router_num_groups or 1,
                  topk_group=moe.moe_router_group_topk or 1,
                  norm_topk_prob=moe.moe_router_topk > 1,
                  routed_scaling_factor=moe.moe_router_topk_scaling_factor or 1.0)
    return hf
