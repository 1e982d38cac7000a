"""Mixtral (MixtralForCausalLM) <-> our GPT with MoE layers; the expert mapping that the
Qwen-MoE families (qwen_moe.py) share.

Attention, norms and head are LLaMA's (llama.py). Every layer is MoE: the router
`block_sparse_moe.gate` is ours, softmax over the top-k logits (= HF's top-k of the
softmax renormalised over the k); expert N's w1 (gate) and w3 (up) rows stack into
our linear_fc1.weight[N] as [gate; up], w2 into linear_fc2.weight[N]. The files are
the hub's per-expert tensors (what transformers' save_pretrained writes).
"""
import torch

from megatron.checkpointing.hf import common as c
from megatron.checkpointing.hf import llama
from megatron.config import MoEConfig

ARCHITECTURES = ("MixtralForCausalLM",)
MIXTRAL_NAMES = ("block_sparse_moe.", "w1", "w3", "w2")
"""(the MoE block's prefix, gate, up and down projection names) of Mixtral's files."""


def model_fields(hf: dict, seq_length=None) -> dict:
    fields = llama.model_fields(hf, seq_length)
    fields["moe"] = MoEConfig(num_experts=hf["num_local_experts"],
                              moe_router_topk=hf["num_experts_per_tok"],
                              moe_ffn_hidden_size=hf["intermediate_size"],
                              moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)))
    return fields


# -- MLPs ---------------------------------------------------------------------------------
def experts_to_megatron(sd, src: str, dst: str, cfg, names, out) -> None:
    """HF's per-expert gate / up / down tensors -> our stacked expert weights."""
    block, gate, up, down = names
    fc1, fc2 = [], []
    for e in range(cfg.moe.num_experts):
        expert = f"{src}{block}experts.{e}."
        fc1.append(torch.cat([c.take(sd, f"{expert}{gate}.weight"), c.take(sd, f"{expert}{up}.weight")]))
        fc2.append(c.take(sd, f"{expert}{down}.weight"))
    out[f"{dst}mlp.router.weight"] = c.take(sd, f"{src}{block}gate.weight")
    out[f"{dst}mlp.experts.linear_fc1.weight"] = torch.stack(fc1)
    out[f"{dst}mlp.experts.linear_fc2.weight"] = torch.stack(fc2)


def experts_to_hf(flat, src: str, dst: str, cfg, names, out) -> None:
    block, gate, up, down = names
    fc1 = c.take(flat, f"{src}mlp.experts.linear_fc1.weight")
    fc2 = c.take(flat, f"{src}mlp.experts.linear_fc2.weight")
    for e in range(cfg.moe.num_experts):
        expert = f"{dst}{block}experts.{e}."
        g, u = fc1[e].chunk(2)
        out[f"{expert}{gate}.weight"], out[f"{expert}{up}.weight"] = g.contiguous(), u.contiguous()
        out[f"{expert}{down}.weight"] = fc2[e].contiguous()
    out[f"{dst}{block}gate.weight"] = c.take(flat, f"{src}mlp.router.weight")


def dense_mlp_to_megatron(sd, src: str, dst: str, prefix: str, out, ours="mlp.") -> None:
    """A gated MLP (gate_proj, up_proj, down_proj under `prefix`) -> ours at `dst + ours`."""
    gate, up = (c.take(sd, f"{src}{prefix}{n}_proj.weight") for n in ("gate", "up"))
    fc1, fc2 = ("dense_h_to_4h", "dense_4h_to_h") if ours == "mlp." else ("linear_fc1", "linear_fc2")
    out[f"{dst}{ours}{fc1}.weight"] = torch.cat([gate, up])
    out[f"{dst}{ours}{fc2}.weight"] = c.take(sd, f"{src}{prefix}down_proj.weight")


def dense_mlp_to_hf(flat, src: str, dst: str, prefix: str, out, ours="mlp.") -> None:
    fc1, fc2 = ("dense_h_to_4h", "dense_4h_to_h") if ours == "mlp." else ("linear_fc1", "linear_fc2")
    gate, up = c.take(flat, f"{src}{ours}{fc1}.weight").chunk(2)
    out[f"{dst}{prefix}gate_proj.weight"] = gate.contiguous()
    out[f"{dst}{prefix}up_proj.weight"] = up.contiguous()
    out[f"{dst}{prefix}down_proj.weight"] = c.take(flat, f"{src}{ours}{fc2}.weight")


def _mlp_to_megatron(sd, i, src, dst, cfg, out) -> None:
    experts_to_megatron(sd, src, dst, cfg, MIXTRAL_NAMES, out)


def _mlp_to_hf(flat, i, src, dst, cfg, out) -> None:
    experts_to_hf(flat, src, dst, cfg, MIXTRAL_NAMES, out)


def to_megatron(sd: c.StateDict, hf: dict, cfg) -> c.StateDict:
    return llama.decoder_to_megatron(sd, hf, cfg, _mlp_to_megatron)


def to_hf(flat: c.StateDict, hf: dict, cfg) -> c.StateDict:
    return llama.decoder_to_hf(flat, hf, cfg, _mlp_to_hf)


def hf_config(cfg, vocab: int) -> dict:
    """The MixtralConfig of a model of ours whose every layer is MoE."""
    hf = llama.hf_config(cfg, vocab)
    for key in ("attention_bias", "mlp_bias", "head_dim"):
        hf.pop(key, None)
    hf.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
              intermediate_size=cfg.moe.moe_ffn_hidden_size or cfg.ffn_hidden_size,
              num_local_experts=cfg.moe.num_experts, num_experts_per_tok=cfg.moe.moe_router_topk,
              router_aux_loss_coef=cfg.moe.moe_aux_loss_coeff, head_dim=cfg.kv_channels)
    return hf
