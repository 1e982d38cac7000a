"""fairseq `transformer_lm` settings and tensors <-> our ModelConfig and names (full tensors).

fairseq's pre-LN decoder: x = embed_scale * embed(tokens) + sinusoids(positions from
padding_idx + 1); per layer x += out_proj(attn(self_attn_layer_norm(x))) with separate
q/k/v projections and the query scaled by head_dim^-0.5 after its bias, then
x += fc2(act(fc1(final_layer_norm(x)))); a final layer_norm; logits = x @ embed^T
(no bias) when the output is shared. Ours computes the same: q/k/v are fused
into per-head [q, k, v] rows, and attention scales the scores of the biased
query (never a folded weight).
"""
from typing import Dict, Optional

import torch

from megatron.checkpointing.fairseq import FairseqError
from megatron.checkpointing.hf import common as c
from megatron.checkpointing.hf.layouts import fuse_qkv, split_qkv

ACTIVATIONS = {"gelu": "exact_gelu", "gelu_accurate": "gelu"}
D = "decoder."
# fairseq settings our model cannot express: (name, value that we support)
UNSUPPORTED = (("decoder_learned_pos", False), ("no_token_positional_embeddings", False),
               ("layernorm_embedding", False), ("no_decoder_final_norm", False),
               ("adaptive_input", False), ("character_embeddings", False),
               ("scale_attn", False), ("scale_fc", False), ("scale_heads", False),
               ("scale_resids", False), ("cross_self_attention", False))
_LAYER = (("self_attn_layer_norm.", "input_layernorm."), ("self_attn.out_proj.", "self_attention.dense."),
          ("final_layer_norm.", "post_attention_layernorm."), ("fc1.", "mlp.dense_h_to_4h."),
          ("fc2.", "mlp.dense_4h_to_h."))
IGNORED = ("decoder.version", "decoder.embed_positions._float_tensor", "decoder.embed_positions.weights")


def _refuse_unsupported(args: Dict, hidden: int) -> None:
    if not args.get("decoder_normalize_before", False):
        raise FairseqError("the fairseq model is post-LN (decoder_normalize_before False); only "
                           "pre-LN models (--decoder-normalize-before) convert")
    for name, ok in UNSUPPORTED:
        if bool(args.get(name, ok)) != ok:
            raise FairseqError(f"fairseq setting {name}={args.get(name)} is not supported")
    if args.get("adaptive_softmax_cutoff"):
        raise FairseqError("fairseq adaptive softmax (adaptive_softmax_cutoff) is not supported")
    for name in ("decoder_input_dim", "decoder_output_dim"):
        if args.get(name) not in (None, hidden):
            raise FairseqError(f"fairseq {name}={args[name]} differs from decoder_embed_dim "
                               f"{hidden} (projection layers) and is not supported")


def model_fields(args: Dict, sd: Dict[str, torch.Tensor], seq_length: Optional[int]) -> dict:
    """ModelConfig fields of a fairseq language model (its args / cfg and its tensors)."""
    hidden = c.take(sd, D + "embed_tokens.weight").shape[1]
    _refuse_unsupported(args, hidden)
    act = args.get("activation_fn", "relu")
    if act not in ACTIVATIONS:
        raise FairseqError(f"fairseq activation_fn {act!r} is not supported "
                           f"(supported: {', '.join(ACTIVATIONS)})")
    layers = len({k.split(".")[2] for k in sd if k.startswith(D + "layers.")})
    heads = args.get("decoder_attention_heads")
    if not heads:
        raise FairseqError("the fairseq settings lack decoder_attention_heads")
    positions = max(int(args.get("tokens_per_sample") or 0),
                    int(args.get("max_target_positions") or 0))
    if positions <= 0:
        raise FairseqError("the fairseq settings give neither tokens_per_sample nor "
                           "max_target_positions (the model's maximum length)")
    share = args.get("share_decoder_input_output_embed", False)
    return dict(num_layers=layers, hidden_size=hidden, num_attention_heads=int(heads),
                ffn_hidden_size=c.take(sd, D + "layers.0.fc1.weight").shape[0],
                max_position_embeddings=positions,
                seq_length=c.sequence_length(seq_length, positions), layernorm_epsilon=1e-5,
                hidden_dropout=float(args.get("dropout", 0.1)),
                attention_dropout=float(args.get("attention_dropout", 0.0)),
                position_embedding_type="sinusoidal",
                scale_embeddings=not args.get("no_scale_embedding", False),
                activation=ACTIVATIONS[act], untie_embeddings_and_output_weights=not share)


def to_megatron(sd: Dict[str, torch.Tensor], cfg) -> Dict[str, torch.Tensor]:
    """Our full state dict (unpadded vocabulary) from fairseq's; unknown tensors are refused."""
    used = set(IGNORED)
    def take(name):
        used.add(name)
        return c.take(sd, name)
    out = {c.WORD: take(D + "embed_tokens.weight")}
    for i in range(cfg.num_layers):
        src, dst = f"{D}layers.{i}.", c.layer(i)
        for kind in ("weight", "bias"):
            q, k, v = (take(f"{src}self_attn.{p}_proj.{kind}") for p in "qkv")
            out[f"{dst}self_attention.query_key_value.{kind}"] = fuse_qkv(q, k, v, cfg.num_attention_heads)
            for theirs, ours in _LAYER:
                out[dst + ours + kind] = take(src + theirs + kind)
    for kind in ("weight", "bias"):
        out[c.FINAL_NORM + kind] = take(f"{D}layer_norm.{kind}")
    if cfg.untie_embeddings_and_output_weights:
        out[c.OUTPUT] = take(D + "output_projection.weight")
    else:
        used.add(D + "output_projection.weight")  # the embedding itself when shared
    unknown = sorted(set(sd) - used)
    if unknown:
        raise FairseqError(f"{len(unknown)} fairseq tensors have no counterpart here, e.g. "
                           f"{unknown[0]}; the architecture is not a supported transformer_lm")
    return out


def to_fairseq(flat: Dict[str, torch.Tensor], cfg) -> Dict[str, torch.Tensor]:
    """fairseq's state dict from our full one (vocabulary rows already cut to the dictionary)."""
    heads, d = cfg.num_attention_heads, cfg.kv_channels
    out = {D + "version": torch.tensor([3.0]), D + "embed_tokens.weight": c.take(flat, c.WORD)}
    for i in range(cfg.num_layers):
        src, dst = c.layer(i), f"{D}layers.{i}."
        for kind in ("weight", "bias"):
            fused = c.take(flat, f"{src}self_attention.query_key_value.{kind}")
            for p, t in zip("qkv", split_qkv(fused, heads, heads, d)):
                out[f"{dst}self_attn.{p}_proj.{kind}"] = t
            for theirs, ours in _LAYER:
                out[dst + theirs + kind] = c.take(flat, src + ours + kind)
    for kind in ("weight", "bias"):
        out[f"{D}layer_norm.{kind}"] = c.take(flat, c.FINAL_NORM + kind)
    head = c.OUTPUT if cfg.untie_embeddings_and_output_weights else c.WORD
    out[D + "output_projection.weight"] = c.take(flat, head)
    return out
