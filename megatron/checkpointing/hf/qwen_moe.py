"""Qwen2-MoE and Qwen3-MoE (Qwen2MoeForCausalLM, Qwen3MoeForCausalLM) <-> our GPT with MoE.

Routing: HF takes the top-k of the softmax over all experts, renormalised over the k
only with norm_topk_prob: ours with --moe-router-pre-softmax unless norm_topk_prob
(the renormalised top-k of the softmax is the softmax over the top-k logits). Layer
i is MoE unless listed in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0
(our --moe-layer-freq list); the other layers are dense gated MLPs of
intermediate_size. Qwen2-MoE: q/k/v biases (ours --add-qkv-bias) and a shared
expert scaled by sigmoid(shared_expert_gate(x)) (ours --moe-shared-expert-gate);
Qwen3-MoE: explicit head_dim and q/k RMSNorm per head (ours --qk-layernorm).
Expert tensors as in mixtral.py, named gate_proj / up_proj / down_proj.
"""
from megatron.checkpointing.hf import common as c
from megatron.checkpointing.hf import llama, qwen2
from megatron.checkpointing.hf import mixtral as moe_map
from megatron.config import MoEConfig

ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
NAMES = ("mlp.", "gate_proj", "up_proj", "down_proj")


def _qwen3(hf: dict) -> bool:
    return "Qwen3MoeForCausalLM" in (hf.get("architectures") or []) or \
        hf.get("model_type") == "qwen3_moe"


def num_experts(hf: dict) -> int:
    """num_experts (Qwen2-MoE) or num_local_experts (Qwen3-MoE's config in transformers 5)."""
    value = c.setting(hf, "num_experts", "num_local_experts")
    c.refuse(value is None, "the config has neither num_experts nor num_local_experts")
    return int(value)


def layer_pattern(hf: dict):
    step, dense = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or [])
    return [int(i not in dense and num_experts(hf) > 0 and (i + 1) % step == 0)
            for i in range(hf["num_hidden_layers"])]


def model_fields(hf: dict, seq_length=None) -> dict:
    base = dict(hf, attention_bias=False, mlp_bias=False)
    base.setdefault("sliding_window", None)
    if not hf.get("use_sliding_window", False):
        base["sliding_window"] = None
    fields = llama.model_fields(base, seq_length)
    shared = hf.get("shared_expert_intermediate_size") if not _qwen3(hf) else None
    fields["moe"] = MoEConfig(
        num_experts=num_experts(hf), moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_layer_freq=layer_pattern(hf),
        moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
        moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)),
        moe_shared_expert_intermediate_size=shared or None, moe_shared_expert_gate=bool(shared))
    if _qwen3(hf):
        fields.update(qk_layernorm=True, add_qkv_bias=bool(hf.get("attention_bias", False)),
                      add_bias_linear=False)
    else:
        fields.update(add_qkv_bias=bool(hf.get("qkv_bias", True)), add_bias_linear=False)
    return fields


def _mlp_to_megatron(sd, i, src, dst, cfg, out) -> None:
    if not cfg.is_moe_layer(i + 1):
        moe_map.dense_mlp_to_megatron(sd, src, dst, "mlp.", out)
        return
    moe_map.experts_to_megatron(sd, src, dst, cfg, NAMES, out)
    if cfg.moe.moe_shared_expert_intermediate_size:
        moe_map.dense_mlp_to_megatron(sd, src, dst, "mlp.shared_expert.", out,
                                      ours="mlp.shared_experts.")
        out[f"{dst}mlp.shared_experts.gate_weight"] = c.take(
            sd, f"{src}mlp.shared_expert_gate.weight")


def _mlp_to_hf(flat, i, src, dst, cfg, out) -> None:
    if not cfg.is_moe_layer(i + 1):
        moe_map.dense_mlp_to_hf(flat, src, dst, "mlp.", out)
        return
    moe_map.experts_to_hf(flat, src, dst, cfg, NAMES, out)
    if cfg.moe.moe_shared_expert_intermediate_size:
        moe_map.dense_mlp_to_hf(flat, src, dst, "mlp.shared_expert.", out,
                                ours="mlp.shared_experts.")
        out[f"{dst}mlp.shared_expert_gate.weight"] = c.take(
            flat, f"{src}mlp.shared_experts.gate_weight")


def to_megatron(sd: c.StateDict, hf: dict, cfg) -> c.StateDict:
    return llama.decoder_to_megatron(sd, hf, cfg, _mlp_to_megatron)


def to_hf(flat: c.StateDict, hf: dict, cfg) -> c.StateDict:
    return llama.decoder_to_hf(flat, hf, cfg, _mlp_to_hf)



def hf_config(cfg, vocab: int) -> dict:
    """The Qwen3MoeConfig (with --qk-layernorm) or Qwen2MoeConfig of a model of ours
    (checked against `model_fields` by the caller): the dense layers are mlp_only_layers."""
    moe = cfg.moe
    arch, model_type = (("Qwen3MoeForCausalLM", "qwen3_moe") if cfg.qk_layernorm
                        else ("Qwen2MoeForCausalLM", "qwen2_moe"))
    hf = qwen2.decoder_config(cfg, vocab, arch, model_type)
    hf.update(num_experts=moe.num_experts, num_experts_per_tok=moe.moe_router_topk,
              moe_intermediate_size=moe.moe_ffn_hidden_size or cfg.ffn_hidden_size,
              decoder_sparse_step=1, norm_topk_prob=not moe.moe_router_pre_softmax,
              mlp_only_layers=[i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i + 1)],
              router_aux_loss_coef=moe.moe_aux_loss_coeff)
    if cfg.qk_layernorm:
        hf["attention_bias"] = False
    else:
        hf.update(qkv_bias=cfg.add_qkv_bias,
                  shared_expert_intermediate_size=moe.moe_shared_expert_intermediate_size or 0)
    return hf
