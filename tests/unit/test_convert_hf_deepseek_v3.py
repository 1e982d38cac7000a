"""DeepseekV3ForCausalLM from Hugging Face and back (megatron/checkpointing/hf/deepseek_v3.py).

Two random models built in-process (nothing downloaded): one with q_lora_rank, a first
dense layer, 2 of 4 expert groups, 2 shared experts, YaRN with mscale / mscale_all_dim
and DeepSeek's MTP layer added to its file; one without q_lora_rank, with half-split
RoPE rows (rope_interleave false) and top-1 unnormalised routing. Each gives transformers'
logits (max relative difference < 1e-5) and 32 greedy tokens (so does one of Kimi-K2's
shape: one group, top-8 of 12, YaRN factor 32 with mscale = mscale_all_dim = 1), and comes back
tensor-identical with its config, generation config and tokenizer files. An FP8 (e4m3,
128 x 128 block scales, partial edge blocks) copy imports as its dequantized weights.
"""
import json
import os
import shutil

import pytest
import torch

from tests import oracles
from tests.gpt_setup import one_thread
from tests.hf_models import (NEW_TOKENS, assert_same_hf_dirs, build_hf_model, converted,
                             greedy_both, load_ours, load_safetensors, position_ids, prompts,
                             rel_err, save_word_tokenizer)

pytestmark = oracles.needs("transformers")
FAMILIES = ("deepseek_v3", "deepseek_v3_no_q_lora", "kimi_k2")


def _random_bias(model, seed: int = 3) -> None:
    """e_score_correction_bias (a buffer the random init leaves at 0) made random."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                bias = module.e_score_correction_bias
                bias.copy_(torch.randn(bias.shape, generator=gen) * 0.1)


def mtp_tensors(model) -> dict:
    """DeepSeek's published MTP layer (index num_hidden_layers): a decoder layer of the
    last layer's kind with enorm / hnorm / eh_proj / shared_head and copies of the
    embedding and head, random."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer
    from tests.hf_models import perturb
    config, n = model.config, model.config.num_hidden_layers
    layer = DeepseekV3DecoderLayer(config, layer_idx=n).float()
    extra = torch.nn.ModuleDict({"enorm": torch.nn.LayerNorm(config.hidden_size, bias=False),
                                 "hnorm": torch.nn.LayerNorm(config.hidden_size, bias=False),
                                 "norm": torch.nn.LayerNorm(config.hidden_size, bias=False),
                                 "eh_proj": torch.nn.Linear(2 * config.hidden_size,
                                                            config.hidden_size, bias=False)})
    perturb(layer, 5)
    perturb(extra, 6)
    _random_bias(layer, 7)
    p = f"model.layers.{n}."
    out = {p + k: v.clone() for k, v in _per_expert(layer.state_dict()).items()}
    out.update({p + "enorm.weight": extra["enorm"].weight.detach().clone(),
                p + "hnorm.weight": extra["hnorm"].weight.detach().clone(),
                p + "shared_head.norm.weight": extra["norm"].weight.detach().clone(),
                p + "eh_proj.weight": extra["eh_proj"].weight.detach().clone(),
                p + "embed_tokens.weight": model.model.embed_tokens.weight.detach().clone(),
                p + "shared_head.head.weight": model.lm_head.weight.detach().clone()})
    return out


def _per_expert(sd: dict) -> dict:
    """transformers' fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) as the
    hub files' per-expert gate_proj / up_proj / down_proj."""
    out = {k: v for k, v in sd.items() if ".experts." not in k}
    for e, (gate_up, down) in enumerate(zip(sd["mlp.experts.gate_up_proj"],
                                            sd["mlp.experts.down_proj"])):
        gate, up = gate_up.chunk(2)
        out.update({f"mlp.experts.{e}.gate_proj.weight": gate, f"mlp.experts.{e}.up_proj.weight": up,
                    f"mlp.experts.{e}.down_proj.weight": down})
    return out


def _fused(sd: dict, experts: int) -> dict:
    """The inverse of `_per_expert`."""
    out = {k: v for k, v in sd.items() if ".experts." not in k}
    out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
        [sd[f"mlp.experts.{e}.gate_proj.weight"], sd[f"mlp.experts.{e}.up_proj.weight"]])
        for e in range(experts)])
    out["mlp.experts.down_proj"] = torch.stack([sd[f"mlp.experts.{e}.down_proj.weight"]
                                                for e in range(experts)])
    return out


def save_with_mtp(name: str, directory: str, **overrides):
    """The random HF model `name` saved to `directory` (the first with DeepSeek's MTP
    layer in its file), returned; `overrides`: config attributes changed."""
    from safetensors.torch import save_file
    model = build_hf_model(name, **overrides)
    _random_bias(model)
    model.save_pretrained(directory, safe_serialization=True)
    if model.config.num_nextn_predict_layers:
        path = os.path.join(directory, "model.safetensors")
        tensors = {**load_safetensors(path), **mtp_tensors(model)}
        save_file({k: v.contiguous() for k, v in tensors.items()}, path,
                  metadata={"format": "pt"})
    return model


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    work = str(tmp_path_factory.mktemp(request.param))
    model = save_with_mtp(request.param, os.path.join(work, "hf"))
    converted(work, request.param)
    return request.param, model, work


@pytest.fixture(scope="module")
def ours(family):
    _, model, work = family
    with one_thread():
        models, tokenizer, _, config = load_ours(os.path.join(work, "ckpt_tp1_pp1"),
                                                 model.config.vocab_size)
    return models[0], tokenizer, config


def test_config_is_read(family, ours):
    name, _, _ = family
    cfg = ours[2].model
    assert cfg.multi_latent_attention and cfg.moe.moe_router_enable_expert_bias
    if name == "deepseek_v3":
        assert cfg.q_lora_rank == 48 and cfg.mtp_num_layers == 1
        assert cfg.moe.layer_pattern(3) == [0, 1, 1]
        assert (cfg.moe.moe_router_num_groups, cfg.moe.moe_router_group_topk) == (4, 2)
        assert cfg.moe.moe_shared_expert_intermediate_size == 64
        assert (cfg.mscale, cfg.mscale_all_dim, cfg.rope_scaling_type) == (0.9, 0.7, "yarn")
    elif name == "deepseek_v3_no_q_lora":
        assert cfg.q_lora_rank is None and cfg.mtp_num_layers is None
        assert cfg.moe.moe_router_num_groups is None
    else:  # Kimi-K2's routing: no groups, top-8 renormalised and scaled
        assert cfg.moe.moe_router_num_groups is None and cfg.moe.moe_router_topk == 8
        assert cfg.moe.moe_router_topk_scaling_factor == 2.827


def test_logits_equal_transformers(family, ours):
    _, hf_model, _ = family
    tokens = prompts(hf_model.config.vocab_size)
    with torch.no_grad(), one_thread():
        expected = hf_model(tokens).logits
        logits = ours[0](tokens, position_ids(tokens))
    assert rel_err(logits[..., :hf_model.config.vocab_size], expected) < 1e-5


def test_greedy_generation_equals_transformers(family, ours):
    expected, got = greedy_both(family[1], ours[0], ours[1])
    assert got == expected and len(got[0]) == NEW_TOKENS


def test_round_trip_gives_identical_tensors_and_files(family, tmp_path):
    """With a tokenizer beside the weights: it travels and comes back, as the config and
    the generation config do; every tensor (the MTP layer's too) comes back identical."""
    from tools import convert_checkpoint
    name, hf_model, work = family
    shutil.copytree(os.path.join(work, "hf"), tmp_path / "hf")
    save_word_tokenizer(str(tmp_path / "hf"), hf_model.config.vocab_size)
    work, back = str(tmp_path), str(tmp_path / "back")
    converted(work, name)
    assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load",
                                    os.path.join(work, "ckpt_tp1_pp1"), "--save", back]) == 0
    assert_same_hf_dirs(os.path.join(work, "hf"), back)


@pytest.mark.parametrize("family", ["deepseek_v3"], indirect=True)  # the one with an MTP layer
def test_mtp_layer_is_deepseeks(family, ours):
    """Our MTP depth 1 computes DeepSeek's layer from the file's tensors: shared_head.norm(
    layer(eh_proj([enorm(e); hnorm(h)]))) with transformers' decoder layer; the MTP loss
    runs in training."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer
    _, hf_model, work = family
    model, config = ours[0], hf_model.config
    n, p = config.num_hidden_layers, f"model.layers.{config.num_hidden_layers}."
    files = load_safetensors(os.path.join(work, "hf", "model.safetensors"))
    layer = DeepseekV3DecoderLayer(config, layer_idx=n).float().eval()
    layer.load_state_dict(_fused({k[len(p):]: v for k, v in files.items() if k.startswith(p)
                                  and k[len(p):].startswith(("self_attn", "mlp", "input", "post"))},
                                 config.n_routed_experts))
    gen = torch.Generator().manual_seed(4)
    h, e = (torch.randn(2, 12, config.hidden_size, generator=gen) for _ in range(2))

    def norm(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * \
            files[p + name + ".weight"]
    x = torch.cat((norm(e, "enorm"), norm(h, "hnorm")), -1) @ files[p + "eh_proj.weight"].T
    positions = position_ids(torch.zeros(2, 12, dtype=torch.long))
    rope = hf_model.model.rotary_emb(x, positions)
    mask = torch.full((12, 12), float("-inf")).triu(1).expand(2, 1, 12, 12)
    with torch.no_grad(), one_thread():
        expected = norm(layer(x, attention_mask=mask, position_embeddings=rope), "shared_head.norm")
        got = model.mtp.layers[0](h.transpose(0, 1), e.transpose(0, 1)).transpose(0, 1)
    assert rel_err(got, expected) < 1e-5
    tokens = prompts(config.vocab_size)
    model.train()
    try:
        with one_thread():
            loss = model(tokens, position_ids(tokens), labels=tokens.roll(-1, 1)).mean()
            loss.backward()
    finally:
        model.eval()
    assert len(model.mtp.losses) == 1 and torch.isfinite(model.mtp.losses[0]).all()
    assert model.mtp.layers[0].eh_proj.weight.grad.abs().sum() > 0


def _quantized(weight: torch.Tensor, block: int = 128):
    """(e4m3 weight, float32 scale_inv per block) of a 2-D weight, as DeepSeek's files:
    each block scaled to the e4m3 range (edge blocks partial)."""
    rows, cols = weight.shape
    br, bc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(br * block, bc * block)
    padded[:rows, :cols] = weight
    blocks = padded.view(br, block, bc, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(br * block, bc * block)[:rows, :cols].contiguous(), scale


def test_fp8_block_scaled_weights_import_dequantized(tmp_path):
    """A float8 copy of the model's 2-D weights (hidden size 200: partial edge
    blocks in both dimensions) imports as the dequantized reference within float8 rounding,
    and the quantization_config is not carried (the weights are no longer float8)."""
    from safetensors.torch import save_file
    from megatron.checkpointing.hf import deepseek_v3
    from tools import convert_checkpoint
    model = build_hf_model("deepseek_v3_no_q_lora", hidden_size=200)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    path = tmp_path / "hf" / "model.safetensors"
    files = load_safetensors(str(path))
    quantized, reference = {}, {}
    for name, t in files.items():
        if t.dim() == 2 and "embed" not in name and "lm_head" not in name:
            q, scale = _quantized(t)
            quantized.update({name: q, name + "_scale_inv": scale})
            blocks = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
            reference[name] = q.float() * blocks[:t.shape[0], :t.shape[1]]
            # float8 rounding: e4m3 keeps 3 mantissa bits (relative step 2^-3)
            assert (reference[name] - t).abs().max() <= t.abs().max() / 8, name
        else:
            quantized[name] = t
    assert files["model.layers.0.mlp.shared_experts.down_proj.weight"].shape == (200, 32)
    save_file(quantized, str(path), metadata={"format": "pt"})
    with open(tmp_path / "hf" / "config.json") as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "weight_block_size": [128, 128]}
    with open(tmp_path / "hf" / "config.json", "w") as f:
        json.dump(config, f)
    hf, imported = deepseek_v3.prepare(config, quantized)
    assert "quantization_config" not in hf
    for name, ref in reference.items():
        assert imported[name].dtype == torch.float32 and torch.equal(imported[name], ref), name
    ckpt = converted(str(tmp_path), "deepseek_v3_no_q_lora")
    back = str(tmp_path / "back")
    assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load", ckpt,
                                    "--save", back]) == 0
    again = load_safetensors(os.path.join(back, "model.safetensors"))
    for name, ref in reference.items():
        assert torch.equal(again[name], ref), name
    with open(os.path.join(back, "config.json")) as f:
        assert "quantization_config" not in json.load(f)


def test_unsupported_settings_are_one_line():
    from megatron.checkpointing.hf import ConversionError, deepseek_v3
    _, config = build_hf_model.__globals__["OTHER_FAMILIES"]["deepseek_v3"]()
    hf = config.to_dict()
    with pytest.raises(ConversionError, match="num_experts_per_tok=3 with topk_group=2"):
        deepseek_v3.model_fields(dict(hf, num_experts_per_tok=3))
    with pytest.raises(ConversionError, match="norm_topk_prob=False with num_experts_per_tok=4"):
        deepseek_v3.model_fields(dict(hf, norm_topk_prob=False))
    with pytest.raises(ConversionError, match="attention_bias=True is not supported"):
        deepseek_v3.model_fields(dict(hf, attention_bias=True))


def test_continue_with_mtp_needs_only_run_flags(tmp_path, monkeypatch, capsys):
    """pretrain_gpt.py --load <converted> with data / batch / schedule / --save flags only:
    the first loss is transformers' on that batch, the MTP depth trains beside it (its
    loss on the log line), and the export carries DeepSeek's MTP layer, trained."""
    import pretrain_gpt
    from tests.gpt_setup import losses
    from tests.unit.test_hf_continue import hf_loss, record_batches, run_flags
    from tools import convert_checkpoint
    hf_dir = str(tmp_path / "hf")
    model = save_with_mtp("deepseek_v3", hf_dir)
    save_word_tokenizer(hf_dir, model.config.vocab_size - 1)
    ckpt = converted(str(tmp_path), "deepseek_v3")
    batches = record_batches(monkeypatch)
    trained, exported = tmp_path / "trained", str(tmp_path / "exported")
    with one_thread():
        state = pretrain_gpt.main(["--load", ckpt, *run_flags(trained)])
    first, expected = losses(state)[0], hf_loss(model, *batches[0])
    assert abs(first - expected) / expected < 1e-5, (first, expected)
    assert " mtp_1 loss: " in capsys.readouterr().out
    assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load",
                                    str(trained), "--save", exported]) == 0
    before = load_safetensors(os.path.join(hf_dir, "model.safetensors"))
    after = load_safetensors(os.path.join(exported, "model.safetensors"))
    assert sorted(after) == sorted(before)
    eh_proj = f"model.layers.{model.config.num_hidden_layers}.eh_proj.weight"
    assert not torch.equal(after[eh_proj], before[eh_proj])


def test_model_trained_here_is_exported_as_deepseek_v3(family, ours, tmp_path):
    """Without the stored HF entry our config alone describes a DeepseekV3ForCausalLM
    (rope_interleave: our pe layout) that transformers loads with the original's logits."""
    from megatron.checkpointing.hf import deepseek_v3
    from megatron.checkpointing.hf.common import OUTPUT, WORD
    from megatron.checkpointing.hf.families import hf_config_for
    from megatron.checkpointing.hf.hf_files import write_hf_dir
    from transformers import AutoModelForCausalLM
    _, hf_model, _ = family
    cfg, vocab = ours[2].model, hf_model.config.vocab_size
    arch, hf = hf_config_for(cfg, vocab)
    assert arch == "DeepseekV3ForCausalLM"
    flat = {k: v[:vocab] if k in (WORD, OUTPUT) else v for k, v in ours[0].state_dict().items()}
    write_hf_dir(str(tmp_path / "hf"), hf, deepseek_v3.to_hf(flat, hf, cfg), None, {})
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"),
                                                    attn_implementation="eager").eval()
    tokens = prompts(vocab)
    with torch.no_grad(), one_thread():
        assert rel_err(exported(tokens).logits, hf_model(tokens).logits) < 1e-5


def test_a_dense_mla_model_converts_both_ways(tmp_path):
    """A DeepseekV3ForCausalLM whose layers are all dense (first_k_dense_replace =
    num_hidden_layers) imports as a dense --multi-latent-attention model with transformers'
    logits, and a dense MLA model of ours exports as DeepseekV3ForCausalLM (not refused
    as a LlamaForCausalLM that cannot express MLA) whose tensors are the original's."""
    from tools import convert_checkpoint
    from megatron.checkpointing.hf.families import hf_config_for
    hf_dir = tmp_path / "hf"
    model = build_hf_model("deepseek_v3", first_k_dense_replace=3, num_nextn_predict_layers=0)
    model.save_pretrained(str(hf_dir), safe_serialization=True)
    ckpt = converted(str(tmp_path), "deepseek_v3")
    vocab = model.config.vocab_size
    with one_thread():
        models, _, _, config = load_ours(ckpt, vocab)
        tokens = prompts(vocab)
        with torch.no_grad():
            logits = models[0](tokens, position_ids(tokens))[..., :vocab]
            assert rel_err(logits, model(tokens).logits) < 1e-5
    assert config.model.multi_latent_attention and config.model.moe is None
    assert hf_config_for(config.model, vocab)[0] == "DeepseekV3ForCausalLM"
    back = str(tmp_path / "back")
    assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load", ckpt,
                                    "--save", back]) == 0
    before = load_safetensors(str(hf_dir / "model.safetensors"))
    after = load_safetensors(os.path.join(back, "model.safetensors"))
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[name], before[name]) for name in before)
