"""Llama 4 (Llama4ForCausalLM; on import also the text part of
Llama4ForConditionalGeneration) <-> our GPT with MoE layers.

Attention is LLaMA's (llama.py: grouped q/k/v fused into our QKV rows, RMSNorms, no
biases) with Llama 4's layer kinds: `no_rope_layers` (1 = RoPE) as --no-rope-freq (1 = no
RoPE), RoPE on interleaved pairs (HF's complex rotation: --rotary-interleaved, so q/k_proj
need no permutation), the weightless L2 norm of q and k after RoPE on the RoPE layers
(use_qk_norm: --qk-l2-norm), chunked attention on the RoPE layers (`attention_chunk_size`,
HF's layer_types chunked_attention: --attention-chunk-size) and the NoPE layers' attention
temperature tuning (attn_temperature_tuning, floor_scale, attn_scale:
--attn-temperature-tuning, --attn-temperature-floor-scale, --attn-temperature-scale).
RoPE scaling: llama3 (rope_parameters / rope_scaling), as llama.py reads it.

MoE layers (`moe_layers`, else every interleave_moe_layer_step-th layer: our
--moe-layer-freq) route top-1 by the sigmoid of the router logit, applied to the expert's
input (--moe-router-score-function sigmoid --moe-apply-probs-on-input), beside an ungated
shared expert of intermediate_size (--moe-shared-expert-intermediate-size). HF stores the
experts fused: feed_forward.experts.gate_up_proj [E, h, 2F] ([gate | up] columns) ->
our linear_fc1.weight [E, 2F, h] ([gate; up] rows), down_proj [E, F, h] -> linear_fc2.weight
[E, h, F]. Dense layers are gated MLPs of intermediate_size_mlp (--ffn-hidden-size). No
auxiliary loss is imported (transformers' Llama 4 computes none; give --moe-aux-loss-coeff
to train with one).
"""
from megatron.checkpointing.hf import common as c
from megatron.checkpointing.hf import llama
from megatron.checkpointing.hf import mixtral as moe_map
from megatron.config import MoEConfig

ARCHITECTURES = ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")
MULTIMODAL = "Llama4ForConditionalGeneration"
CHUNKED, FULL = "chunked_attention", "full_attention"
# Llama4TextConfig's defaults (transformers 5.25: Llama-4-Scout-17B-16E's sizes), for the
# partial text_config of a multimodal config.json (a unit test compares them with
# transformers').
DEFAULTS = dict(vocab_size=202_048, hidden_size=5120, intermediate_size=8192,
                intermediate_size_mlp=16_384, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, head_dim=128, hidden_act="silu",
                max_position_embeddings=131_072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                attention_dropout=0.0, num_experts_per_tok=1, num_local_experts=16,
                interleave_moe_layer_step=1, use_qk_norm=True, router_aux_loss_coef=0.001,
                no_rope_layer_interval=4, attention_chunk_size=8192,
                attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1,
                attention_bias=False, rope_theta=500_000.0)
_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
_TEXT_HEADS = ("language_model.lm_head.weight", "lm_head.weight")
FF = "feed_forward."


def text_part(arch: str, hf: dict):
    """(architecture, config, note): a multimodal config's text model as the
    Llama4ForCausalLM it is, with a one-line note (gemma3.text_part's way)."""
    if arch != MULTIMODAL:
        return arch, hf, None
    text, note = c.multimodal_text_config(hf, MULTIMODAL, DEFAULTS, ARCHITECTURES[0],
                                          "llama4_text")
    return ARCHITECTURES[0], text, note


# -- the config ------------------------------------------------------------------------
def rope_layers(hf: dict) -> list:
    """HF's no_rope_layers: 1 for each RoPE layer, 0 for each NoPE one (its default: every
    no_rope_layer_interval-th layer NoPE)."""
    n = hf["num_hidden_layers"]
    listed = hf.get("no_rope_layers")
    if not listed:
        interval = int(hf.get("no_rope_layer_interval") or 4)
        return [int((i + 1) % interval != 0) for i in range(n)]
    c.refuse(len(listed) < n, f"no_rope_layers lists {len(listed)} layers, the model has {n}")
    return [int(bool(v)) for v in listed[:n]]


def moe_pattern(hf: dict) -> list:
    """1 for each MoE layer: `moe_layers`, else every interleave_moe_layer_step-th."""
    n, listed = hf["num_hidden_layers"], hf.get("moe_layers")
    if listed is None:
        step = int(hf.get("interleave_moe_layer_step") or 1)
        listed = range(step - 1, n, step)
    chosen = set(listed)
    return [int(i in chosen) for i in range(n)]


def _every_nth(pattern: list):
    """The int N when exactly every N-th entry (1-based) is 1 and N divides the length,
    else the list; None when none is 1."""
    if not any(pattern):
        return None
    n = pattern.index(1) + 1
    if len(pattern) % n == 0 and pattern == [int((i + 1) % n == 0) for i in range(len(pattern))]:
        return n
    return list(pattern)


def _moe_layer_freq(pattern: list):
    """--moe-layer-freq of a pattern: 1 when every layer is MoE, else the list (our int N
    counts from layer 0, HF's step from layer N - 1)."""
    return 1 if all(pattern) else list(pattern)


def _check_layer_types(hf: dict, rope: list) -> None:
    """Explicit layer_types must be what HF derives: chunked exactly on the RoPE layers."""
    types = hf.get("layer_types")
    if types is None:
        return
    chunked = hf.get("attention_chunk_size") is not None
    derived = [CHUNKED if r and chunked else FULL for r in rope]
    c.refuse(list(types) != derived, f"layer_types {list(types)} are not supported (Llama 4 "
                                     f"chunks exactly its RoPE layers: {derived})")


def _attention_fields(hf: dict) -> dict:
    rope = rope_layers(hf)
    _check_layer_types(hf, rope)
    chunk = hf.get("attention_chunk_size")
    return dict(rotary_interleaved=True, no_rope_freq=_every_nth([1 - r for r in rope]),
                qk_l2_norm=bool(hf.get("use_qk_norm")),
                attention_chunk_size=None if chunk is None or not any(rope) else int(chunk),
                attn_temperature_tuning=bool(hf.get("attn_temperature_tuning")),
                attn_temperature_floor_scale=int(hf.get("floor_scale")),
                attn_temperature_scale=float(hf.get("attn_scale")))


def _moe(hf: dict):
    pattern = moe_pattern(hf)
    if not any(pattern):
        return None
    k = int(hf["num_experts_per_tok"])
    c.refuse(k != 1, f"num_experts_per_tok={k} is not supported (Llama 4 routes top-1: "
                     f"the sigmoid score scales the expert's input)")
    return MoEConfig(num_experts=int(hf["num_local_experts"]), moe_router_topk=1,
                     moe_router_score_function="sigmoid", moe_apply_probs_on_input=True,
                     moe_ffn_hidden_size=int(hf["intermediate_size"]),
                     moe_shared_expert_intermediate_size=int(hf["intermediate_size"]),
                     moe_layer_freq=_moe_layer_freq(pattern))  # no auxiliary loss: HF's
    # Llama 4 computes none (its router_aux_loss_coef is unused by transformers)


def model_fields(hf: dict, seq_length=None) -> dict:
    hf = dict(DEFAULTS, **hf)
    c.refuse(bool(hf.get("attention_bias")), "attention_bias=True is not supported for "
             "Llama 4 (our output projection has a bias only with biased MLPs)")
    base = dict(hf, intermediate_size=hf["intermediate_size_mlp"], attention_bias=False,
                mlp_bias=False, architectures=["LlamaForCausalLM"], sliding_window=None)
    fields = llama.model_fields(base, seq_length)
    fields.update(_attention_fields(hf))
    fields["moe"] = _moe(hf)
    return fields


def _rope_parameters(cfg) -> dict:
    params = dict(llama._rope_scaling(cfg))
    params.setdefault("rope_type", "default")
    params["rope_theta"] = float(cfg.rotary_base)
    return params


def _moe_config(cfg) -> dict:
    moe = cfg.moe if cfg.moe is not None and cfg.moe.enabled else None
    layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i + 1)]
    if moe is None:
        return dict(moe_layers=[], num_local_experts=1, num_experts_per_tok=1,
                    intermediate_size=cfg.ffn_hidden_size)
    size = moe.moe_ffn_hidden_size or cfg.ffn_hidden_size
    c.refuse(moe.moe_shared_expert_intermediate_size != size,
             f"Llama 4's shared expert is as wide as its experts ({size}); "
             f"--moe-shared-expert-intermediate-size is "
             f"{moe.moe_shared_expert_intermediate_size}")
    return dict(moe_layers=layers, num_local_experts=moe.num_experts,
                num_experts_per_tok=moe.moe_router_topk, intermediate_size=size,
                router_aux_loss_coef=moe.moe_aux_loss_coeff)


def hf_config(cfg, vocab: int) -> dict:
    """The Llama4TextConfig of a model of ours (checked against `model_fields` by the caller)."""
    hf = llama.hf_config(cfg, vocab)
    for key in ("mlp_bias", "rope_theta", "rope_scaling", "sliding_window"):
        hf.pop(key, None)
    rope = [int(cfg.uses_rope(n)) for n in range(1, cfg.num_layers + 1)]
    chunk = cfg.attention_chunk_size
    hf.update(architectures=[ARCHITECTURES[0]], model_type="llama4_text",
              intermediate_size_mlp=cfg.ffn_hidden_size, no_rope_layers=rope,
              attention_chunk_size=chunk, use_qk_norm=cfg.qk_l2_norm,
              layer_types=[CHUNKED if r and chunk is not None else FULL for r in rope],
              attn_temperature_tuning=cfg.attn_temperature_tuning,
              floor_scale=cfg.attn_temperature_floor_scale,
              attn_scale=cfg.attn_temperature_scale, rope_parameters=_rope_parameters(cfg),
              **_moe_config(cfg))
    return hf


# -- tensors -------------------------------------------------------------------------------
def _mlp_to_megatron(sd, i, src, dst, cfg, out) -> None:
    if not cfg.is_moe_layer(i + 1):
        moe_map.dense_mlp_to_megatron(sd, src, dst, FF, out)
        return
    e = f"{src}{FF}experts."
    out[f"{dst}mlp.router.weight"] = c.take(sd, f"{src}{FF}router.weight")
    out[f"{dst}mlp.experts.linear_fc1.weight"] = c.take(sd, e + "gate_up_proj").transpose(
        1, 2).contiguous()
    out[f"{dst}mlp.experts.linear_fc2.weight"] = c.take(sd, e + "down_proj").transpose(
        1, 2).contiguous()
    moe_map.dense_mlp_to_megatron(sd, src, dst, FF + "shared_expert.", out,
                                  ours="mlp.shared_experts.")


def _mlp_to_hf(flat, i, src, dst, cfg, out) -> None:
    if not cfg.is_moe_layer(i + 1):
        moe_map.dense_mlp_to_hf(flat, src, dst, FF, out)
        return
    e = f"{dst}{FF}experts."
    out[f"{dst}{FF}router.weight"] = c.take(flat, f"{src}mlp.router.weight")
    out[e + "gate_up_proj"] = c.take(flat, f"{src}mlp.experts.linear_fc1.weight").transpose(
        1, 2).contiguous()
    out[e + "down_proj"] = c.take(flat, f"{src}mlp.experts.linear_fc2.weight").transpose(
        1, 2).contiguous()
    moe_map.dense_mlp_to_hf(flat, src, dst, FF + "shared_expert.", out,
                            ours="mlp.shared_experts.")


def to_megatron(sd: c.StateDict, hf: dict, cfg) -> c.StateDict:
    sd = c.text_model_weights(sd, _TEXT_PREFIXES, _TEXT_HEADS)
    return llama.decoder_to_megatron(sd, hf, cfg, _mlp_to_megatron)


def to_hf(flat: c.StateDict, hf: dict, cfg) -> c.StateDict:
    return llama.decoder_to_hf(flat, hf, cfg, _mlp_to_hf)
