"""The launch scripts in examples/ pass flags that parse and fit their world size.

Each script runs with `python`, `torchrun`, `srun` and `deepspeed` replaced by stubs that record their
arguments; the recorded pretrain_gpt.py flags then go through pretrain_gpt's own
parsing and layout checks, with the world size the launcher would create.
"""
import os
import subprocess
from pathlib import Path

import pytest

import pretrain_gpt
from megatron.arguments import parse_args
from tests.conftest import ROOT

SCRIPTS = ["pretrain_gpt.sh", "pretrain_gpt_distributed.sh", "pretrain_gpt3_175B.sh",
           "megatron_11b.sh", "pretrain_llama2_7b.sh", "pretrain_llama3_8b.sh",
           "pretrain_qwen2.5_7b.sh", "pretrain_qwen3_8b.sh",
           "pretrain_bloom_176b.sh", "pretrain_gpt_multinode.sh", "pretrain_gpt_slurm.sh",
           "pretrain_mixtral_8x7b.sh", "pretrain_qwen3_moe.sh", "pretrain_gemma3_12b.sh",
           "pretrain_gpt_oss_20b.sh", "pretrain_deepseek_v3.sh", "pretrain_deepseek_v2_lite.sh",
           "pretrain_llama4_scout.sh"]
STUB = '#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$RECORD"\n'


def recorded_launch(tmp_path: Path, script: str, **env) -> list:
    """The arguments `script` passes to its launcher (python, torchrun, srun or deepspeed,
    all stubbed); `env` overrides the script's environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python", "torchrun", "srun", "deepspeed"):
        (bin_dir / name).write_text(STUB)
        (bin_dir / name).chmod(0o755)
    record = tmp_path / "argv"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(record),
           "DATA": "data/prefix", "VOCAB": "vocab.json", "MERGE": "merges.txt",
           "TOKENIZER": "tokenizer_dir", "MASTER_ADDR": "node0",
           "RDZV_ENDPOINT": "node0:29400", **env}
    subprocess.run(["bash", str(ROOT / "examples" / script)], env=env, check=True, timeout=60)
    return record.read_text().splitlines()


def _value(args: list, flags: tuple, default: int) -> int:
    for flag in flags:
        if flag in args:
            return int(args[args.index(flag) + 1])
    return default


def launcher_world_size(launcher: list) -> int:
    """torchrun's processes per node (or srun's tasks, or deepspeed's GPUs) x nodes."""
    return (_value(launcher, ("--nproc_per_node", "--ntasks-per-node", "--num_gpus"), 1)
            * _value(launcher, ("--nnodes", "--nodes"), 1))


def parsed_launch(tmp_path: Path, script: str):
    """(config, world size) of the pretrain_gpt.py launch a script makes."""
    args = recorded_launch(tmp_path, script)
    assert "pretrain_gpt.py" in args, args
    launcher, flags = args[:args.index("pretrain_gpt.py")], args[args.index("pretrain_gpt.py") + 1:]
    world = launcher_world_size(launcher)
    config, _ = parse_args(flags, world_size=world, required=pretrain_gpt.REQUIRED)
    return config, world


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_flags_parse_for_their_world_size(tmp_path, script):
    config, _ = parsed_launch(tmp_path, script)
    assert config.data.data_path


LLAMA = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, normalization="RMSNorm",
             layernorm_epsilon=1e-5, activation="swiglu", position_embedding_type="rope",
             untie_embeddings_and_output_weights=True, add_bias_linear=False)
PRESETS = {
    "pretrain_llama2_7b.sh": dict(LLAMA, ffn_hidden_size=11008, seq_length=4096,
                                  num_query_groups=32, rotary_base=10000),
    "pretrain_llama3_8b.sh": dict(LLAMA, ffn_hidden_size=14336, seq_length=8192,
                                  num_query_groups=8, rotary_base=500000),
    "pretrain_qwen2.5_7b.sh": dict(LLAMA, num_layers=28, hidden_size=3584,
                                   num_attention_heads=28, ffn_hidden_size=18944,
                                   seq_length=4096, num_query_groups=4, rotary_base=1000000,
                                   layernorm_epsilon=1e-6, add_qkv_bias=True),
    "pretrain_qwen3_8b.sh": dict(LLAMA, num_layers=36, ffn_hidden_size=12288, seq_length=4096,
                                 num_query_groups=8, kv_channels=128, qk_layernorm=True,
                                 rotary_base=1000000, layernorm_epsilon=1e-6),
    "pretrain_bloom_176b.sh": dict(num_layers=70, hidden_size=14336, num_attention_heads=112,
                                   seq_length=2048, position_embedding_type="alibi",
                                   embed_layernorm=True, normalization="LayerNorm",
                                   untie_embeddings_and_output_weights=False,
                                   pad_vocab_size_to=250880),
    "pretrain_mixtral_8x7b.sh": dict(LLAMA, ffn_hidden_size=14336, seq_length=4096,
                                     num_query_groups=8, rotary_base=1000000),
    "pretrain_qwen3_moe.sh": dict(num_layers=48, hidden_size=2048, num_attention_heads=32,
                                  kv_channels=128, num_query_groups=4, qk_layernorm=True,
                                  normalization="RMSNorm", layernorm_epsilon=1e-6,
                                  rotary_base=1000000, add_bias_linear=False),
    "pretrain_gemma3_12b.sh": dict(num_layers=48, hidden_size=3840, num_attention_heads=16,
                                   kv_channels=256, num_query_groups=8, ffn_hidden_size=15360,
                                   seq_length=8192, max_position_embeddings=131072,
                                   normalization="RMSNorm", layernorm_epsilon=1e-6,
                                   apply_layernorm_1p=True, sandwich_norm=True,
                                   qk_layernorm=True, activation="geglu_tanh",
                                   add_bias_linear=False, embedding_multiplier=3840 ** 0.5,
                                   untie_embeddings_and_output_weights=False,
                                   rotary_base=1000000, rotary_base_local=10000,
                                   rotary_seq_len_interpolation_factor=8.0,
                                   rope_scaling_local=False, window_size=1024,
                                   window_attn_skip_freq=6),
    # gpt-oss-20b's config.json
    "pretrain_gpt_oss_20b.sh": dict(num_layers=24, hidden_size=2880, num_attention_heads=64,
                                    kv_channels=64, num_query_groups=8, ffn_hidden_size=2880,
                                    normalization="RMSNorm", layernorm_epsilon=1e-5,
                                    rotary_base=150000, rope_scaling_type="yarn",
                                    rope_scaling_factor=32.0,
                                    rope_scaling_original_max_position_embeddings=4096,
                                    yarn_correction_range_round_to_int=False,
                                    max_position_embeddings=131072, window_size=128,
                                    window_attn_skip_freq=2, softmax_type="learnable",
                                    activation="quick_geglu", glu_linear_offset=1.0,
                                    activation_func_clamp_value=7.0, add_bias_linear=True,
                                    untie_embeddings_and_output_weights=True,
                                    pad_vocab_size_to=201088),
    # Llama-4-Scout-17B-16E: Llama4TextConfig's defaults (+ its RoPE scaling, README)
    "pretrain_llama4_scout.sh": dict(num_layers=48, hidden_size=5120, num_attention_heads=40,
                                     kv_channels=128, num_query_groups=8, ffn_hidden_size=16384,
                                     normalization="RMSNorm", layernorm_epsilon=1e-5,
                                     rotary_base=500000, rotary_interleaved=True,
                                     rope_scaling_type="llama3", rope_scaling_factor=16.0,
                                     no_rope_freq=4, attention_chunk_size=8192, qk_l2_norm=True,
                                     attn_temperature_tuning=True,
                                     attn_temperature_floor_scale=8192,
                                     attn_temperature_scale=0.1, activation="swiglu",
                                     add_bias_linear=False,
                                     untie_embeddings_and_output_weights=True,
                                     pad_vocab_size_to=202048)}
MOE_PRESETS = {
    "pretrain_mixtral_8x7b.sh": (32, dict(num_experts=8, moe_router_topk=2, moe_grouped_gemm=True,
                                          moe_aux_loss_coeff=1e-2,
                                          moe_token_dispatcher_type="alltoall"), (1, 4, 8)),
    "pretrain_qwen3_moe.sh": (16, dict(num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
                                       moe_aux_loss_coeff=1e-3, moe_router_dtype="fp32"), (1, 2, 8)),
    "pretrain_gpt_oss_20b.sh": (8, dict(num_experts=32, moe_router_topk=4, moe_ffn_hidden_size=2880,
                                        moe_router_pre_softmax=False), (1, 1, 8)),
    "pretrain_deepseek_v3.sh": (1024, dict(num_experts=256, moe_router_topk=8,
                                          moe_ffn_hidden_size=2048, moe_router_num_groups=8,
                                          moe_router_group_topk=4,
                                          moe_router_score_function="sigmoid",
                                          moe_router_enable_expert_bias=True,
                                          moe_router_topk_scaling_factor=2.5,
                                          moe_shared_expert_intermediate_size=2048,
                                          moe_router_load_balancing_type="seq_aux_loss",
                                          moe_aux_loss_coeff=1e-4), (2, 8, 64)),
    "pretrain_deepseek_v2_lite.sh": (16, dict(num_experts=64, moe_router_topk=6,
                                              moe_ffn_hidden_size=1408,
                                              moe_router_score_function="softmax",
                                              moe_router_topk_scaling_factor=None,
                                              moe_shared_expert_intermediate_size=2816,
                                              moe_aux_loss_coeff=1e-3), (1, 1, 16)),
    "pretrain_llama4_scout.sh": (32, dict(num_experts=16, moe_router_topk=1,
                                          moe_ffn_hidden_size=8192,
                                          moe_router_score_function="sigmoid",
                                          moe_apply_probs_on_input=True,
                                          moe_shared_expert_intermediate_size=8192), (4, 2, 8)),
}


@pytest.mark.parametrize("script", sorted(MOE_PRESETS))
def test_moe_presets(tmp_path, script):
    """The MoE presets parse at their world size with Megatron-LM's MoE flags and layout."""
    config, world = parsed_launch(tmp_path, script)
    want_world, moe, (tp, pp, ep) = MOE_PRESETS[script]
    assert world == want_world
    for name, value in moe.items():
        assert getattr(config.model.moe, name) == value, name
    p = config.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
            p.expert_model_parallel_size) == (tp, pp, ep)
    dense = DEEPSEEK_MODEL.get(script, {}).get("first_dense", 0)  # Megatron-LM counts from 1
    assert not any(config.model.is_moe_layer(n) for n in range(1, dense + 1))
    assert config.model.is_moe_layer(dense + 1)
    assert config.model.is_moe_layer(config.model.num_layers)


@pytest.mark.parametrize("script", sorted(PRESETS))
def test_architecture_presets(tmp_path, script):
    config, _ = parsed_launch(tmp_path, script)
    for name, value in PRESETS[script].items():
        assert getattr(config.model, name) == value, name
    assert config.training.bf16


def test_every_example_script_is_checked():
    launchers = {p.name for p in (ROOT / "examples").glob("*.sh")
                 if "pretrain_gpt.py" in p.read_text() or "source examples/" in p.read_text()}
    compat = {"megatron_deepspeed_gpt2.sh", "deepspeed_zero1_gpt.sh",  # test_compat_examples.py
              "megatron_lm_gpt_recompute.sh"}
    sourced = {"qwen_dense.sh",  # the dense Qwen presets' shared launch, checked through them
               "deepseek_moe.sh"}  # the DeepSeek presets' shared launch
    assert launchers - {"quickstart.sh"} - compat - sourced == set(SCRIPTS)  # quickstart: README command 1


@pytest.mark.parametrize("script, architecture", [("pretrain_qwen2.5_7b.sh", "Qwen2ForCausalLM"),
                                                  ("pretrain_qwen3_8b.sh", "Qwen3ForCausalLM"),
                                                  ("pretrain_llama3_8b.sh", "LlamaForCausalLM"),
                                                  ("pretrain_gemma3_12b.sh", "Gemma3ForCausalLM"),
                                                  ("pretrain_gpt_oss_20b.sh", "GptOssForCausalLM"),
                                                  ("pretrain_llama4_scout.sh", "Llama4ForCausalLM")])
def test_presets_export_as_their_family(tmp_path, script, architecture):
    from megatron.checkpointing.hf.families import hf_config_for
    config, _ = parsed_launch(tmp_path, script)
    assert hf_config_for(config.model, 151936)[0] == architecture


def test_gpt_oss_preset_alternates_sliding_and_full_layers(tmp_path):
    config, _ = parsed_launch(tmp_path, "pretrain_gpt_oss_20b.sh")
    model = config.model
    assert [model.window_for_layer(n) for n in (1, 2, 3, 24)] == [128, None, 128, None]


# DeepSeek-V3's and DeepSeek-V2-Lite's config.json (transformers' DeepseekV3Config defaults
# are V3's): the MLA ranks and head sizes, the first dense layers, YaRN and MTP
DEEPSEEK_MODEL = {
    "pretrain_deepseek_v3.sh": dict(
        first_dense=3, num_layers=61, hidden_size=7168, num_attention_heads=128,
        ffn_hidden_size=18432, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
        qk_pos_emb_head_dim=64, v_head_dim=128, rope_scaling_type="yarn",
        rope_scaling_factor=40.0, rope_scaling_original_max_position_embeddings=4096,
        mscale=1.0, mscale_all_dim=1.0, mtp_num_layers=1, mtp_loss_scaling_factor=0.1),
    "pretrain_deepseek_v2_lite.sh": dict(
        first_dense=1, num_layers=27, hidden_size=2048, num_attention_heads=16,
        ffn_hidden_size=10944, q_lora_rank=None, kv_lora_rank=512, qk_head_dim=128,
        qk_pos_emb_head_dim=64, v_head_dim=128, rope_scaling_type="yarn",
        rope_scaling_factor=40.0, rope_scaling_original_max_position_embeddings=4096,
        mscale=0.707, mscale_all_dim=0.707, mtp_num_layers=None)}


@pytest.mark.parametrize("script", sorted(DEEPSEEK_MODEL))
def test_deepseek_presets_have_their_published_shape(tmp_path, script):
    config, _ = parsed_launch(tmp_path, script)
    for name, value in DEEPSEEK_MODEL[script].items():
        if name != "first_dense":
            assert getattr(config.model, name) == value, name
    assert config.training.bf16 and config.model.multi_latent_attention


def test_deepseek_v3_preset_uses_megatron_lms_pipeline_layout(tmp_path):
    """"Et|(tt|)*30mL" over PP 8: 4 virtual stages; the embedding and layer 0 first, two
    layers a chunk, the MTP layer and the loss alone in the last chunk."""
    from megatron.pipeline.layout import pipeline_layout
    config, _ = parsed_launch(tmp_path, "pretrain_deepseek_v3.sh")
    p, m = config.parallel, config.model
    assert p.pipeline_model_parallel_layout == "Et|(tt|)*30mL"
    assert p.sequence_parallel and p.expert_tensor_parallel_size == 1
    layout = pipeline_layout(m.num_layers, 8, layout=p.pipeline_model_parallel_layout,
                             mtp_num_layers=m.mtp_num_layers)
    assert layout.vp_size == 4 and layout.stages[0] == "Et" and layout.stages[-1] == "mL"
    assert layout.place(60) == (6, 3, 1)
