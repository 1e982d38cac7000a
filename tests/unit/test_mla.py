"""Multi-latent attention in one process: its flags (Megatron-LM's names and defaults, bad
settings one line and exit 2), the sharding metadata of its parameters, and generation
with the compressed KV cache (the normed latent and the rotated RoPE key per token and
layer) giving the tokens of an expanded cache (keys and values per head) and of a forward
over the whole sequence."""
import pytest
import torch

from megatron.arguments import parse_args
from megatron.config import ModelConfig
from megatron.model import GPTModel
from megatron.model.mla import MLASelfAttention
from megatron.mpu import model_parallel_seed
from megatron.mpu.sharding import merge_shards, parameter_meta, shard_tensor
from megatron.text_generation import KVCache, generate
from megatron.text_generation.inference import forward_with_cache
from megatron.tokenizer import ByteLevelTokenizer
from tests.gpt_setup import assert_exits_2_with_one_line

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--train-iters", "10",
        "--lr", "1e-3"]
MLA = ["--multi-latent-attention", "--position-embedding-type", "rope"]


def mla_config(**overrides) -> ModelConfig:
    values = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32,
                  max_position_embeddings=64, padded_vocab_size=384, hidden_dropout=0.0,
                  attention_dropout=0.0, init_method_std=0.2, position_embedding_type="rope",
                  normalization="RMSNorm", add_bias_linear=False, multi_latent_attention=True,
                  q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4,
                  v_head_dim=6, rope_scaling_type="yarn", rope_scaling_factor=4.0,
                  rope_scaling_original_max_position_embeddings=16, mscale=0.9,
                  mscale_all_dim=0.7)
    values.update(overrides)
    return ModelConfig(**values)


def mla_model(**overrides) -> GPTModel:
    model_parallel_seed(1234, 0)
    model = GPTModel(mla_config(**overrides))
    model.init_weights(3)
    return model.eval()


def test_flags_take_megatron_lm_defaults():
    m = parse_args(BASE + MLA)[0].model
    assert m.multi_latent_attention and m.q_lora_rank is None
    assert (m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim) == (32, 128, 64, 128)
    assert (m.mscale, m.mscale_all_dim) == (1.0, 0.0)
    m = parse_args(BASE + MLA + ["--q-lora-rank", "8", "--kv-lora-rank", "4", "--v-head-dim",
                                 "2", "--mscale-all-dim", "0.5"])[0].model
    assert (m.q_lora_rank, m.kv_lora_rank, m.v_head_dim, m.mscale_all_dim) == (8, 4, 2, 0.5)
    assert m.rotary_dim == 64 and m.query_projection_size == 4 * 2
    # Megatron-LM's default positions (learned absolute) stay on top of MLA's RoPE, as in
    # Megatron-Core's GPTModel
    m = parse_args(BASE + ["--multi-latent-attention"])[0].model
    assert m.position_embedding_type == "learned_absolute"


@pytest.mark.parametrize("flags, world, words", [
    (["--kv-lora-rank", "16"], 1, ["--kv-lora-rank 16 needs --multi-latent-attention"]),
    (["--q-lora-rank", "16"], 1, ["--q-lora-rank 16 needs --multi-latent-attention"]),
    (["--multi-latent-attention", "--position-embedding-type", "alibi"], 1,
     ["--position-embedding-type alibi", "use rope"]),
    (MLA + ["--qk-pos-emb-head-dim", "5"], 1, ["--qk-pos-emb-head-dim must be even", "5"]),
    (MLA + ["--kv-lora-rank", "0"], 1, ["--kv-lora-rank must be positive, got 0"]),
    (MLA + ["--qk-layernorm"], 1, ["drop --qk-layernorm"]),
    (MLA + ["--tensor-model-parallel-size", "3"], 3, ["--num-attention-heads (4)", "3"]),
], ids=["kv-rank-without-mla", "q-rank-without-mla", "alibi", "odd-rope-dim",
        "zero-rank", "qk-layernorm", "tp-not-dividing-heads"])
def test_bad_settings_exit_2_with_one_line(capsys, flags, world, words):
    assert_exits_2_with_one_line(capsys, lambda: parse_args(BASE + flags, world_size=world),
                                 words)


@pytest.mark.parametrize("q_lora_rank", [16, None])
def test_every_parameter_shards_and_merges_back(q_lora_rank):
    """Each MLA parameter's sharding metadata splits it over TP 2 into whole heads (the up
    projections), rows of the output projection's input, or replicas (down projections
    and norms), and merging gives the tensor back."""
    model = mla_model(q_lora_rank=q_lora_rank)
    attention = model.language_model.encoder.layers[0].self_attention
    expected = {"linear_q_proj.weight": 0, "linear_q_up_proj.weight": 0,
                "linear_kv_up_proj.weight": 0, "dense.weight": 1,
                "linear_q_down_proj.weight": None, "linear_kv_down_proj.weight": None,
                "q_layernorm.weight": None, "kv_layernorm.weight": None}
    names = dict(attention.named_parameters())
    assert set(names) <= set(expected) and "linear_kv_down_proj.weight" in names
    for name, param in names.items():
        meta = parameter_meta(param)
        assert meta["dim"] == expected[name], name
        shards = [shard_tensor(param.detach(), meta, r, 2) for r in range(2)]
        assert torch.equal(merge_shards(shards, meta), param.detach()), name


@pytest.mark.parametrize("positions", ["rope", "learned_absolute"])
def test_compressed_cache_holds_latent_and_rope_key_and_gives_the_same_tokens(positions):
    model = mla_model(position_embedding_type=positions)
    tok = ByteLevelTokenizer()
    prompts = ["Hello", "a longer prompt than that", [5, 6, 7]]
    cached = generate(model, tok, prompts, 24, greedy=True, eod_stop=False)
    full = generate(model, tok, prompts, 24, greedy=True, eod_stop=False, use_cache=False)
    assert cached == full
    assert len({tuple(ids) for ids in cached}) == 3 and len(set(cached[0])) > 3
    cache = KVCache.for_model(model, 2, 20)
    forward_with_cache(model, torch.randint(0, 256, (2, 20)), cache)
    cfg = model.cfg
    for layer in (1, 2):
        per_token = (cache.keys[layer][0, 0].numel() + cache.values[layer][0, 0].numel())
        assert per_token == cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim


class ExpandedCacheMLA(MLASelfAttention):
    """The same attention caching the expanded keys and values instead of the latents."""

    def forward(self, hidden, mask, inference_params=None):
        q = self._query(hidden)
        latent, k_pe = self._latent(hidden)
        q, k_pe = self._rope(q, k_pe, inference_params)
        k, v = self._keys_values(latent, k_pe)
        if inference_params is not None:
            k, v = inference_params.update(self.layer_number, k, v)
        return self.dense(self._attention(q * self.query_scale, k, v, mask))


def _cache_values_per_token(model, tokens):
    cache = KVCache.for_model(model, tokens.shape[0], tokens.shape[1])
    forward_with_cache(model, tokens, cache)
    return sum(cache.keys[n][0, 0].numel() + cache.values[n][0, 0].numel() for n in cache.keys)


def test_compressed_and_expanded_caches_give_the_same_tokens():
    model = mla_model()
    tok = ByteLevelTokenizer()
    prompts = ["Hello", "a longer prompt than that"]
    tokens = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    compressed = generate(model, tok, prompts, 24, greedy=True, eod_stop=False)
    compressed_size = _cache_values_per_token(model, tokens)
    for module in model.modules():
        if isinstance(module, MLASelfAttention):
            module.__class__ = ExpandedCacheMLA
    assert generate(model, tok, prompts, 24, greedy=True, eod_stop=False) == compressed
    cfg = model.cfg
    assert compressed_size == cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim)
    heads = cfg.num_attention_heads
    assert _cache_values_per_token(model, tokens) == cfg.num_layers * heads * (
        cfg.qk_head_dim + cfg.qk_pos_emb_head_dim + cfg.v_head_dim)


def test_cpu_kernel_serves_narrower_values_padded(monkeypatch):
    """Under `auto` with our kernels chosen, values narrower than q / k (MLA's) go through
    the CPU kernel zero-padded; outputs and gradients equal SDPA's on the unpadded ones."""
    from megatron import fused
    from megatron.fused import choice
    from megatron.model.attention import CoreAttention
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(64, 2, 4, 32, generator=g) for _ in range(2))
    v, dy = torch.randn(64, 2, 4, 16, generator=g), torch.randn(64, 2, 64, generator=g)
    if not fused.causal_attention_fusable(q, k, torch.nn.functional.pad(v, (0, 16))):
        pytest.skip("the CPU attention kernel is not built here")
    monkeypatch.setenv(choice.MODE_ENV, "ours")
    offered = []
    kernel = fused.causal_attention
    monkeypatch.setattr(fused, "causal_attention",
                        lambda q, k, v, *a: offered.append(v.shape) or kernel(q, k, v, *a))
    results = {}
    for impl in ("auto", "sdpa"):
        cfg = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=64,
                          max_position_embeddings=64, attention_impl=impl, attention_dropout=0.0)
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = CoreAttention(cfg, 1)(*inputs, None)
        out.backward(dy)
        results[impl] = [out.detach()] + [t.grad for t in inputs]
    assert offered == [torch.Size([64, 2, 4, 32])]  # auto only, values padded to 32
    for got, want in zip(results["auto"], results["sdpa"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_flags_have_help_and_are_in_the_readme():
    from megatron.arguments import build_parser
    from tests.data_setup import ROOT
    readme = (ROOT / "README.md").read_text()
    actions = build_parser()._option_string_actions
    for flag in ("--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
                 "--qk-pos-emb-head-dim", "--v-head-dim", "--mscale", "--mscale-all-dim"):
        assert actions[flag].help and f"`{flag}" in readme, flag


@pytest.mark.parametrize("q_lora_rank", [16, None])
def test_flops_count_the_matmuls_of_the_attention(q_lora_rank):
    """The attention terms of the layer FLOPs (megatron/training/flops.py) equal what
    torch's FLOP counter sees in MLA's forward (explicit softmax path, full s x s scores)."""
    from torch.utils.flop_counter import FlopCounterMode
    from megatron.training.flops import layer_forward_flops
    cfg = mla_config(q_lora_rank=q_lora_rank, attention_impl="torch", seq_length=32)
    attention = mla_model(q_lora_rank=q_lora_rank, attention_impl="torch",
                          seq_length=32).language_model.encoder.layers[0].self_attention
    with FlopCounterMode(display=False) as counter:
        attention(torch.randn(32, 3, 32), None)
    f = layer_forward_flops(cfg, 3 * 32)
    assert counter.get_total_flops() == f.qkv + f.scores + f.context + f.dense
