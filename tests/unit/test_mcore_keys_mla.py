"""Megatron-Core keys of multi-latent attention layers (mcore_keys.py; the names a GPTModel from
get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True) saves, measured on
Megatron-Core 0.16.1: unfused input_layernorm / pre_mlp_layernorm, the MLA names as ours)."""
from megatron.checkpointing.mcore_keys import mcore_key

LAYER = "language_model.encoder.layers.3."
MTP = "mtp.layers.0.transformer_layer."


def test_mla_layer_norms_are_not_fused():
    assert mcore_key(LAYER + "input_layernorm.weight", mla=True) == (
        "decoder.layers.input_layernorm.weight", 3)
    assert mcore_key(LAYER + "post_attention_layernorm.weight", mla=True) == (
        "decoder.layers.pre_mlp_layernorm.weight", 3)
    assert mcore_key(MTP + "post_attention_layernorm.weight", mla=True) == (
        "mtp.layers.0.transformer_layer.pre_mlp_layernorm.weight", None)
    assert mcore_key(LAYER + "input_layernorm.weight") == (  # without MLA: fused names
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight", 3)


def test_mla_projections_keep_their_names():
    for name in ("linear_q_down_proj", "q_layernorm", "linear_q_up_proj", "linear_q_proj",
                 "linear_kv_down_proj", "kv_layernorm", "linear_kv_up_proj"):
        assert mcore_key(f"{LAYER}self_attention.{name}.weight", mla=True) == (
            f"decoder.layers.self_attention.{name}.weight", 3)
    assert mcore_key(LAYER + "self_attention.dense.weight", mla=True) == (
        "decoder.layers.self_attention.linear_proj.weight", 3)
    assert mcore_key(LAYER + "mlp.dense_h_to_4h.weight", False, mla=True) == (
        "decoder.layers.3.mlp.linear_fc1.weight", None)
