"""Gemma 3 (Gemma3ForCausalLM; on import also the text part of
Gemma3ForConditionalGeneration) <-> our GPT.

Gemma's arithmetic (gemma.py: sqrt(hidden) embedding scale, tanh GeGLU, (1 + w) RMSNorms,
tied embeddings) with Gemma 3's layer: sandwich norms (--sandwich-norm: HF's
post_attention_layernorm is our post_self_attention_layernorm, its pre_feedforward_layernorm
our pre-MLP post_attention_layernorm, its post_feedforward_layernorm our post_mlp_layernorm),
(1 + w) q / k norms (--qk-layernorm), query_pre_attn_scalar ** -0.5 as the softmax scale
(--softmax-scale), and per-layer attention kinds: `layer_types` (sliding_attention /
full_attention) as --window-size with --window-attn-skip-freq, the sliding layers' RoPE base
(rope_parameters["sliding_attention"]) as --rotary-base-local, and the full layers' linear
RoPE scaling as --rotary-seq-len-interpolation-factor with --no-rope-scaling-local (HF
scales the full-attention layers only).
"""
from megatron.checkpointing.hf import common as c
from megatron.checkpointing.hf import gemma, llama

ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
MULTIMODAL = "Gemma3ForConditionalGeneration"
SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma3TextConfig's defaults (transformers 5.24), for the partial text_config of a
# multimodal config.json (a unit test compares them with transformers').
DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216,
                num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
                rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
                attention_dropout=0.0, query_pre_attn_scalar=256, sliding_window=4096,
                final_logit_softcapping=None, attn_logit_softcapping=None,
                use_bidirectional_attention=False)
THETAS = {FULL: 1_000_000.0, SLIDING: 10_000.0}
# (HF's norm, ours) around each layer's attention and MLP, besides input_layernorm
_NORMS = (("post_attention_layernorm.", "post_self_attention_layernorm."),
          ("pre_feedforward_layernorm.", "post_attention_layernorm."),
          ("post_feedforward_layernorm.", "post_mlp_layernorm."))
# Where Gemma3ForConditionalGeneration's files keep the text model (old and new names)
_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
_TEXT_HEADS = ("language_model.lm_head.weight", "lm_head.weight")


def text_part(arch: str, hf: dict):
    """(architecture, config, note) of what is imported: a multimodal config's text model as
    the Gemma3ForCausalLM it is, with a one-line note that the vision tower is left out;
    else `arch`, the config itself and no note."""
    if arch != MULTIMODAL:
        return arch, hf, None
    text, note = c.multimodal_text_config(hf, MULTIMODAL, DEFAULTS, ARCHITECTURES[0],
                                          "gemma3_text")
    return ARCHITECTURES[0], text, note


def _layer_types(hf: dict) -> list:
    types = hf.get("layer_types")
    if types is None:  # older configs: every sliding_window_pattern-th layer is full
        pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(hf["num_hidden_layers"])]
    bad = sorted(set(types) - {SLIDING, FULL})
    c.refuse(bool(bad), f"layer_types {bad} are not supported (only {SLIDING}, {FULL})")
    c.refuse(len(types) != hf["num_hidden_layers"], f"layer_types has {len(types)} entries for "
                                                    f"{hf['num_hidden_layers']} layers")
    return list(types)


def _rope_of(hf: dict, kind: str) -> dict:
    """The RoPE parameters of one layer type, in the old and the new config formats."""
    params = dict((hf.get("rope_parameters") or {}).get(kind) or {})
    if kind == FULL:
        params.update(hf.get("rope_scaling") or {})
    old = hf.get("rope_theta") if kind == FULL else hf.get("rope_local_base_freq")
    params.setdefault("rope_theta", old if old is not None else THETAS[kind])
    return params


def _skip_freq(types: list):
    """--window-attn-skip-freq of the layer types: every N-th full as an int, else a list."""
    full = [i + 1 for i, t in enumerate(types) if t == FULL]
    if full and full == list(range(full[0], len(types) + 1, full[0])):
        return full[0]
    return [int(t == SLIDING) for t in types]


def _attention_kinds(hf: dict) -> dict:
    """window_size, window_attn_skip_freq, the RoPE bases and the global layers' scaling."""
    types, full, local = _layer_types(hf), _rope_of(hf, FULL), _rope_of(hf, SLIDING)
    c.refuse(local.get("rope_type", "default") != "default",
             f"RoPE scaling {local.get('rope_type')!r} on sliding-window layers is not supported")
    kind = full.get("rope_type", "default")
    c.refuse(kind not in ("default", "linear"),
             f"rope scaling {kind!r} is not supported for Gemma 3 (default or linear)")
    fields = llama._rope({"rope_parameters": full})
    if SLIDING not in types:
        return fields
    fields["window_size"] = int(hf["sliding_window"])
    if float(local["rope_theta"]) != float(fields["rotary_base"]):
        fields["rotary_base_local"] = int(local["rope_theta"])
    if FULL in types:
        fields["window_attn_skip_freq"] = _skip_freq(types)
    if kind == "linear":
        fields["rope_scaling_local"] = False
    return fields


def model_fields(hf: dict, seq_length=None) -> dict:
    hf = dict(DEFAULTS, **hf)
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        c.refuse(hf.get(name) is not None, f"{name}={hf[name]} is not supported (no soft-capping)")
    c.refuse(bool(hf.get("use_bidirectional_attention")),
             "use_bidirectional_attention=True is not supported (our attention is causal)")
    flat = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling",
                                                     "rope_theta", "sliding_window")}
    fields = gemma.model_fields(flat, seq_length)
    scalar = hf["query_pre_attn_scalar"]
    scale = None if scalar == fields["kv_channels"] else float(scalar) ** -0.5
    return dict(fields, **_attention_kinds(hf), sandwich_norm=True, qk_layernorm=True,
                softmax_scale=scale)


def _text_weights(sd: c.StateDict) -> c.StateDict:
    """A multimodal file's text model under Gemma3ForCausalLM's names (the vision tower and
    projector left out); the tensors of a Gemma3ForCausalLM file as they are."""
    return c.text_model_weights(sd, _TEXT_PREFIXES, _TEXT_HEADS)


def _norms_to_megatron(sd, i, src, dst, cfg, out) -> None:
    """The MLP and Gemma 3's norms; llama's attention mapping put HF's post-attention norm
    (Gemma 3's norm of the attention output) where our pre-MLP norm belongs: overwritten."""
    for theirs, ours in _NORMS:
        c.pair_to_megatron(sd, src + theirs, dst + ours, out, bias=False)
    llama._mlp_to_megatron(sd, i, src, dst, cfg, out)


def _norms_to_hf(flat, i, src, dst, cfg, out) -> None:
    for theirs, ours in _NORMS:
        c.pair_to_hf(flat, src + ours, dst + theirs, out, bias=False)
    llama._mlp_to_hf(flat, i, src, dst, cfg, out)


def to_megatron(sd: c.StateDict, hf: dict, cfg) -> c.StateDict:
    return llama.decoder_to_megatron(_text_weights(sd), hf, cfg, _norms_to_megatron)


def to_hf(flat: c.StateDict, hf: dict, cfg) -> c.StateDict:
    return llama.decoder_to_hf(flat, hf, cfg, _norms_to_hf)


def _query_pre_attn_scalar(cfg):
    """query_pre_attn_scalar of our softmax scale (an int where it is one)."""
    if cfg.softmax_scale is None:
        return cfg.kv_channels
    value = cfg.softmax_scale ** -2
    return round(value) if abs(value - round(value)) < 1e-9 * value else value


def _layer_kinds_config(cfg) -> dict:
    """layer_types, sliding_window and rope_parameters of our per-layer attention kinds."""
    windows = [cfg.window_for_layer(n) for n in range(1, cfg.num_layers + 1)]
    types = [FULL if w is None else SLIDING for w in windows]
    full = {"rope_type": "default", "rope_theta": float(cfg.rotary_base)}
    scaling = llama._rope_scaling(cfg)
    if scaling:
        full.update(scaling)
    local = {"rope_type": "default", "rope_theta": float(cfg.rotary_base_for_layer(
        types.index(SLIDING) + 1) if SLIDING in types else cfg.rotary_base)}
    return dict(layer_types=types, sliding_window=cfg.window_size or DEFAULTS["sliding_window"],
                rope_parameters={FULL: full, SLIDING: local})


def hf_config(cfg, vocab: int) -> dict:
    """The Gemma3TextConfig of a model of ours (checked against `model_fields` by the caller)."""
    hf = gemma.hf_config(cfg, vocab)
    for name in ("rope_theta", "rope_scaling", "sliding_window", "hidden_act"):
        hf.pop(name, None)
    hf.update(architectures=[ARCHITECTURES[0]], model_type="gemma3_text",
              hidden_activation="gelu_pytorch_tanh",
              query_pre_attn_scalar=_query_pre_attn_scalar(cfg), final_logit_softcapping=None,
              attn_logit_softcapping=None, use_bidirectional_attention=False,
              **_layer_kinds_config(cfg))
    return hf
