"""Small random Hugging Face models of each supported family, saved with safetensors,
and our side of the comparison (the model the loading path builds from a converted
checkpoint). Shared by the conversion tests."""
import json
import os

import torch

from megatron.arguments import build_parser

PROMPT_LEN, NEW_TOKENS = 8, 32


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel, GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=211,
                                       n_positions=96, layer_norm_epsilon=1e-5)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM, LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, vocab_size=203, max_position_embeddings=96, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False)


def _mistral():  # multi-query (one K/V head): TP 2 holds replicas of it
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM, MistralConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, intermediate_size=96, vocab_size=190, max_position_embeddings=96,
        rms_norm_eps=1e-6, sliding_window=128, tie_word_embeddings=False)


def _bloom():  # 6 heads: ALiBi slopes of a non-power-of-two head count, 3 per TP rank
    from transformers import BloomConfig, BloomForCausalLM
    return BloomForCausalLM, BloomConfig(hidden_size=48, n_layer=2, n_head=6, vocab_size=199,
                                         layer_norm_epsilon=1e-5)


def _qwen2():  # QKV bias without output bias; tied embeddings as the small Qwen2.5 models
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM, Qwen2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, vocab_size=197, max_position_embeddings=96, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=True)


def _qwen3():  # per-head q/k RMSNorm; head_dim 32 != hidden / heads = 16
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM, Qwen3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=96, vocab_size=193, max_position_embeddings=96,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)


def _gemma():  # sqrt(h) embedding scale, tanh GeGLU, 1 + w RMSNorm, head_dim 32 != 64 / 4
    from transformers import GemmaConfig, GemmaForCausalLM
    return GemmaForCausalLM, GemmaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, intermediate_size=96, vocab_size=189, max_position_embeddings=96,
        rms_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh")


def _gemma3():  # sandwich and q / k norms, query_pre_attn_scalar 24 != head_dim 16, windows of
    # 8 on layers 1-3 with RoPE base 10k, full layer 4 with base 1M and linear scaling 8
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    return Gemma3ForCausalLM, Gemma3TextConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, vocab_size=187, max_position_embeddings=96,
        rms_norm_eps=1e-6, query_pre_attn_scalar=24, sliding_window=8,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], rope_parameters=rope)


FAMILIES = {"gpt2": _gpt2, "llama": _llama, "mistral": _mistral, "bloom": _bloom,
            "qwen2": _qwen2, "qwen3": _qwen3, "gemma": _gemma, "gemma3": _gemma3}


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM, MixtralConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, vocab_size=197, max_position_embeddings=96, rms_norm_eps=1e-5,
        num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6, tie_word_embeddings=False)


def _qwen2_moe():  # a shared expert with its sigmoid gate; layer 1 dense (mlp_only_layers)
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    return Qwen2MoeForCausalLM, Qwen2MoeConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1], vocab_size=193,
        max_position_embeddings=96, rms_norm_eps=1e-6, tie_word_embeddings=False)


def _qwen3_moe():  # q/k norms, explicit head_dim, renormalised top-k
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM, Qwen3MoeConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, vocab_size=191, max_position_embeddings=96,
        rms_norm_eps=1e-6, tie_word_embeddings=False)


MOE_FAMILIES = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe}


def _gpt_oss():  # sinks, biases, yarn (truncate false), sliding / full layers, window 8
    from transformers import GptOssConfig, GptOssForCausalLM
    return GptOssForCausalLM, GptOssConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        vocab_size=203, max_position_embeddings=128, sliding_window=8, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 32, "rope_theta": 150000.0})


def _deepseek_v3():  # q_lora_rank, a first dense layer, 2 of 4 groups, 2 shared, YaRN mscale
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    return DeepseekV3ForCausalLM, DeepseekV3Config(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=96,
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=4, n_group=4,
        topk_group=2, n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=24, vocab_size=199, max_position_embeddings=128, rms_norm_eps=1e-6,
        num_nextn_predict_layers=1,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 0.7,
                         "original_max_position_embeddings": 32, "rope_theta": 10000.0})


def _deepseek_v3_no_q_lora():  # q_proj, half-split RoPE rows, no groups, top-1 unnormalised
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    return DeepseekV3ForCausalLM, DeepseekV3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=96,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=1, n_group=1,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=0, routed_scaling_factor=1.5,
        norm_topk_prob=False, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, vocab_size=201, max_position_embeddings=96,
        rms_norm_eps=1e-6, rope_interleave=False, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _kimi_k2():  # Kimi-K2's shape: one group, top-8, one shared, first layer dense, YaRN 32
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    return DeepseekV3ForCausalLM, DeepseekV3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=96, moe_intermediate_size=16, n_routed_experts=12, num_experts_per_tok=8,
        n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=2.827, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, vocab_size=163, max_position_embeddings=256,
        rms_norm_eps=1e-6, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 1.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 8, "rope_theta": 50000.0})


def _llama4():  # chunks of 16 on RoPE layers 1-3, layer 4 NoPE with temperature tuning
    # (floor_scale 8: it changes the queries within 64 positions), q / k L2 norm, llama3
    # RoPE scaling, layers 2 and 4 MoE (4 experts top-1, shared expert), 1 and 3 dense
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    return Llama4ForCausalLM, Llama4TextConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=32, intermediate_size_mlp=96, num_local_experts=4,
        num_experts_per_tok=1, interleave_moe_layer_step=2, vocab_size=203,
        max_position_embeddings=128, rms_norm_eps=1e-5, no_rope_layers=[1, 1, 1, 0],
        attention_chunk_size=16, attn_temperature_tuning=True, floor_scale=8, attn_scale=0.1,
        use_qk_norm=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                         "rope_theta": 500000.0})


OTHER_FAMILIES = {"gpt_oss": _gpt_oss, "llama4": _llama4, "deepseek_v3": _deepseek_v3,
                  "deepseek_v3_no_q_lora": _deepseek_v3_no_q_lora,
                  "kimi_k2": _kimi_k2}  # tested in their own files
SEQ_LENGTH = {"bloom": 96}  # BLOOM has no position table: --seq-length at conversion


def perturb(model, seed: int) -> None:
    """Random weights far from the init: norms and biases that are not 1 / 0 make
    mapping mistakes show in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and name.endswith("weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def build_hf_model(family: str, seed: int = 0, vocab_size=None, **overrides):
    """A float32, eager-attention random model of `family` (config attributes changed by
    `overrides`), in eval mode."""
    cls, config = {**FAMILIES, **MOE_FAMILIES, **OTHER_FAMILIES}[family]()
    config.vocab_size = vocab_size or config.vocab_size
    for name, value in overrides.items():
        setattr(config, name, value)
    config.bos_token_id = config.eos_token_id = config.pad_token_id = None
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    perturb(model, seed)
    return model.eval()


def save_hf_model(family: str, directory: str, seed: int = 0, vocab_size=None, **overrides):
    model = build_hf_model(family, seed, vocab_size, **overrides)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def prompts(vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (2, PROMPT_LEN + NEW_TOKENS),
                         generator=torch.Generator().manual_seed(seed))


def hf_greedy(model, prompt: torch.Tensor):
    out = model.generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, attention_mask=torch.ones_like(prompt))
    return out[:, prompt.shape[1]:].tolist()


def load_ours(ckpt: str, vocab: int, tp: int = 1, pp: int = 1, pstate=None, extra=()):
    """(model chunks, tokenizer, pstate, config) through the loading path of the entry
    points: flags read from the checkpoint, tokenizer with `vocab` ids (NullTokenizer).
    A `pstate` of the same layout is reused instead of building new groups."""
    from megatron.training.initialize import initialize_distributed
    from megatron.training.checkpoint_setup import (build_tokenizer_and_vocab, load_inference_models,
                                                parse_inference_args)
    argv = ["--load", ckpt, "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab - 1),
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--use-cpu-initialization", *extra]
    config, _, stored = parse_inference_args(build_parser(), argv)
    tokenizer = build_tokenizer_and_vocab(config, stored)
    if pstate is None:
        pstate, _ = initialize_distributed(config)
    models, _ = load_inference_models(config, pstate, torch.device("cpu"), parallel_output=False)
    return models, tokenizer, pstate, config


def pipeline_logits(ckpt: str, vocab: int, tokens: torch.Tensor, pstate, **layout):
    """(logits [..., :vocab] on the last stage, None on the first; pstate) of a PP 2
    checkpoint loaded by `load_ours(ckpt, vocab, pp=2, **layout)` on two ranks."""
    import torch.distributed as dist
    models, _, pstate, config = load_ours(ckpt, vocab, pp=2, pstate=pstate, **layout)
    model, positions = models[0], position_ids(tokens)
    with torch.no_grad():
        if pstate.pp_rank == 0:
            dist.send(model(tokens, positions).contiguous(), pstate.next_rank)
            return None, pstate
        hidden = torch.empty(tokens.shape[1], tokens.shape[0], config.model.hidden_size)
        dist.recv(hidden, pstate.prev_rank)
        model.set_input_tensor(hidden)
        return model(tokens, positions)[..., :vocab], pstate


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def position_ids(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1]).expand_as(tokens)


def converted(tmp_dir: str, family: str, tp: int = 1, pp: int = 1) -> str:
    from tools import convert_checkpoint
    hf_dir, ckpt = os.path.join(tmp_dir, "hf"), os.path.join(tmp_dir, f"ckpt_tp{tp}_pp{pp}")
    argv = ["--from", "hf", "--to", "megatron", "--load", hf_dir, "--save", ckpt,
            "--target-tensor-model-parallel-size", str(tp),
            "--target-pipeline-model-parallel-size", str(pp)]
    if family in SEQ_LENGTH:
        argv += ["--seq-length", str(SEQ_LENGTH[family])]
    assert convert_checkpoint.main(argv) == 0
    return ckpt


def converted_family(name: str, tmp_path_factory):
    """(name, HF model, work dir holding hf/ and the TP 1 conversion ckpt_tp1_pp1/): the
    module fixture of the conversion tests."""
    work = str(tmp_path_factory.mktemp(name))
    model = save_hf_model(name, os.path.join(work, "hf"))
    converted(work, name)
    return name, model, work


def load_converted(family):
    """`load_ours` of a `converted_family`'s TP 1 checkpoint, on one thread."""
    from tests.gpt_setup import one_thread
    _, model, work = family
    with one_thread():
        return load_ours(os.path.join(work, "ckpt_tp1_pp1"), model.config.vocab_size)


def save_word_tokenizer(directory: str, size: int) -> None:
    """A word-level tokenizer of `size` ids ("0" .. str(size - 1)) saved as HF files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tokenizer = Tokenizer(models.WordLevel({str(i): i for i in range(size)}, unk_token="0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="0",
                            eos_token="1").save_pretrained(directory)


def load_safetensors(path: str) -> dict:
    from safetensors.torch import load_file
    return load_file(path)


def round_trip(family, back: str):
    """(the HF files' tensors, those of `--to hf` of the family's TP 1 conversion, written
    to `back`): what a round trip test compares."""
    from tools import convert_checkpoint
    work = family[2]
    assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load",
                                    os.path.join(work, "ckpt_tp1_pp1"), "--save", back]) == 0
    original = load_safetensors(os.path.join(work, "hf", "model.safetensors"))
    again = load_safetensors(os.path.join(back, "model.safetensors"))
    assert sorted(again) == sorted(original)
    return original, again


def greedy_both(hf_model, model, tokenizer):
    """(transformers' NEW_TOKENS greedy tokens, ours with the KV cache) after the first
    PROMPT_LEN tokens of `prompts`, on one thread."""
    from megatron.text_generation import generate
    from tests.gpt_setup import one_thread
    prompt = prompts(hf_model.config.vocab_size)[:, :PROMPT_LEN]
    with one_thread():
        return hf_greedy(hf_model, prompt), generate(
            model, tokenizer, prompt.tolist(), NEW_TOKENS, greedy=True, eod_stop=False,
            use_cache=True)


def assert_same_hf_dirs(original: str, back: str) -> None:
    """`back` holds the files of `original`, its tensors identical (dtype too) and its
    JSON files (config, generation config, tokenizer) equal."""
    assert sorted(os.listdir(back)) == sorted(os.listdir(original))
    first = load_safetensors(os.path.join(original, "model.safetensors"))
    again = load_safetensors(os.path.join(back, "model.safetensors"))
    assert sorted(again) == sorted(first)
    for key, tensor in first.items():
        assert again[key].dtype == tensor.dtype and torch.equal(again[key], tensor), key
    for name in os.listdir(original):
        if name.endswith(".json"):
            with open(os.path.join(original, name)) as a, open(os.path.join(back, name)) as b:
                assert json.load(a) == json.load(b), name


def check_multimodal_text_part(model, tmp_path, capsys, multimodal: str, text: str):
    """A saved multimodal model (in tmp_path / "hf") imports as its text model `text`, said
    in one line naming `multimodal`, with the logits of its text-only forward within 1e-5,
    and exports as `text`. Returns (export dir, tokens, expected logits)."""
    from tests.gpt_setup import one_thread
    from tools import convert_checkpoint
    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
    assert convert_checkpoint.main(["--from", "hf", "--to", "megatron", "--load",
                                    str(tmp_path / "hf"), "--save", ckpt]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "vision tower" in line]
    assert len(notes) == 1 and multimodal in notes[0], notes
    vocab = model.config.text_config.vocab_size
    tokens = prompts(vocab)
    with torch.no_grad(), one_thread():
        expected = model(input_ids=tokens).logits
        ours = load_ours(ckpt, vocab)[0][0]
        assert rel_err(ours(tokens, position_ids(tokens))[..., :vocab], expected) < 1e-5
    assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load", ckpt,
                                    "--save", back]) == 0
    with open(os.path.join(back, "config.json")) as f:
        assert json.load(f)["architectures"] == [text]
    return back, tokens, expected
