"""Per-layer attention kinds (issue 31): which layers have the sliding window
(--window-attn-skip-freq), their own RoPE base (--rotary-base-local) and no RoPE at all
(--no-rope-freq). The patterns are checked against Megatron-Core 0.16.1's own code; a model
with mixed layers against a chain of uniform layers holding the same weights, and its KV
cache decoding against its full forward."""
import pytest
import torch

from megatron.arguments import parse_args
from megatron.config import ModelConfig
from megatron.model import GPTModel
from megatron.model.transformer import ParallelTransformerLayer
from megatron.mpu import model_parallel_seed
from megatron.text_generation import KVCache, forward_full, forward_with_cache
from tests import oracles
from tests.gpt_setup import assert_exits_2_with_one_line
from tests.mcore_setup import run_mcore_script

PATTERNS = [2, 6, 1, 5, [1, 0, 1, 1, 0, 1], [0, 0, 0, 0, 0, 0]]
MCORE_PATTERNS = r"""
import json, sys
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
cases = json.load(sys.stdin)
windows = [[is_layer_window_attention((4, 0), freq, n) for n in range(1, 7)] for freq in cases]
nope = []
for freq in (2, 3, 6, [1, 0, 0, 0, 1, 1]):
    cfg = TransformerConfig(num_layers=6, hidden_size=64, num_attention_heads=4,
                            no_rope_freq=freq)
    nope.append(cfg.no_rope_freq)
print(json.dumps({"windows": windows, "nope": nope}))
"""


def config(**kw) -> ModelConfig:
    base = dict(num_layers=6, hidden_size=64, num_attention_heads=4, seq_length=16,
                max_position_embeddings=16, padded_vocab_size=96, hidden_dropout=0.0,
                attention_dropout=0.0, position_embedding_type="rope")
    base.update(kw)
    return ModelConfig(**base)


@oracles.needs("megatron-core")
def test_layer_patterns_equal_megatron_cores():
    theirs = run_mcore_script(MCORE_PATTERNS, PATTERNS)
    for freq, windows in zip(PATTERNS, theirs["windows"]):
        cfg = config(window_size=4, window_attn_skip_freq=freq)
        assert [cfg.window_for_layer(n) is not None for n in range(1, 7)] == windows, freq
    for freq, nope in zip((2, 3, 6, [1, 0, 0, 0, 1, 1]), theirs["nope"]):
        cfg = config(no_rope_freq=freq)
        assert [int(not cfg.uses_rope(n)) for n in range(1, 7)] == nope, freq


def test_list_form_text_and_defaults():
    cfg = config(window_size=4, window_attn_skip_freq="([1]*2+[0]*1)*2", rotary_base=1000000,
                 rotary_base_local=10000, no_rope_freq="[0]*5+[1]")
    assert [cfg.window_for_layer(n) for n in range(1, 7)] == [4, 4, None, 4, 4, None]
    assert [cfg.rotary_base_for_layer(n) for n in range(1, 7)] == [10000, 10000, 1000000] * 2
    assert [cfg.uses_rope(n) for n in range(1, 7)] == [True] * 5 + [False]
    assert cfg.masked_layers(16) == [1, 2, 4, 5] and cfg.masked_layers(4) == []
    # an MTP layer (number past --num-layers) is of the last decoder layer's kinds
    assert (cfg.window_for_layer(7), cfg.rotary_base_for_layer(7), cfg.uses_rope(7)) == \
        (None, 1000000, False)
    plain = config(window_size=4)
    assert [plain.window_for_layer(n) for n in range(1, 7)] == [4] * 6
    assert [plain.rotary_base_for_layer(n) for n in range(1, 7)] == [10000] * 6


MIXED = dict(num_layers=4, window_size=3, window_attn_skip_freq=2, rotary_base=10000,
             rotary_base_local=50, no_rope_freq=[0, 0, 1, 0], qk_layernorm=True)


def _model(cfg) -> GPTModel:
    model_parallel_seed(1234, 0)
    model = GPTModel(cfg)
    model.init_weights(7)
    return model.eval()


def test_each_layer_attends_as_its_kind():
    """The mixed model's layers equal uniform layers of their own kind with their weights;
    and each kind matters (the window, the local base and NoPE each change the output)."""
    cfg = config(**MIXED)
    model = _model(cfg)
    x = torch.randn(12, 2, 64, generator=torch.Generator().manual_seed(0))
    full = dict(window_size=None, rotary_base=10000)
    kinds = [dict(window_size=3, rotary_base=50), full,
             dict(window_size=3, rotary_base=50, position_embedding_type="none"), full]
    mixed, chained = x, x
    with torch.no_grad():
        for n, (layer, kind) in enumerate(zip(model.language_model.encoder.layers, kinds), 1):
            uniform = ParallelTransformerLayer(config(**{**MIXED, **kind,
                                                         "window_attn_skip_freq": None,
                                                         "rotary_base_local": None,
                                                         "no_rope_freq": None}), n, None,
                                               None, torch.float32).eval()
            uniform.load_state_dict(layer.state_dict())
            mixed, chained = layer(mixed), uniform(chained)
            torch.testing.assert_close(mixed, chained, rtol=1e-6, atol=1e-6)
            assert (layer.self_attention.rotary is None) == (n == 3)
            assert layer.self_attention.core_attention.window == kind.get("window_size")


def test_each_kind_changes_the_output():
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    reference = forward_full(_model(config(**MIXED)), ids)
    for change in (dict(window_attn_skip_freq=None), dict(rotary_base_local=None),
                   dict(no_rope_freq=None)):
        other = forward_full(_model(config(**{**MIXED, **change})), ids)
        assert (other - reference).abs().max() > 1e-4, change


def test_kv_cache_decoding_equals_the_full_forward():
    model = _model(config(**MIXED))
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    full = forward_full(model, ids)
    cache = KVCache.for_model(model, 2, 12)
    parts = [forward_with_cache(model, ids[:, a:b], cache, last_only=False)
             for a, b in ((0, 5), (5, 6), (6, 9), (9, 12))]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


FLAGS = ["--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
         "--lr", "1e-3", "--train-iters", "1", "--position-embedding-type", "rope"]


@pytest.mark.parametrize("argv, words", [
    (["--window-attn-skip-freq", "2"], ["--window-attn-skip-freq", "needs --window-size"]),
    (["--window-size", "4", "--window-attn-skip-freq", "[1,0]"],
     ["lists 2 entries", "one per layer (6)"]),
    (["--window-size", "4", "--window-attn-skip-freq", "0"], ["must be positive, got 0"]),
    (["--window-size", "4", "--window-attn-skip-freq", "os.system('x')"],
     ["--window-attn-skip-freq", "neither an int nor a list"]),
    (["--rotary-base-local", "100"], ["--rotary-base-local 100", "needs --window-size"]),
    (["--no-rope-freq", "4"], ["--no-rope-freq 4 must divide --num-layers (6)"]),
    (["--no-rope-freq", "2", "--position-embedding-type", "learned_absolute"],
     ["--no-rope-freq", "needs --position-embedding-type rope"]),
])
def test_bad_layer_kinds_are_one_line_exit_2(argv, words, capsys):
    assert_exits_2_with_one_line(capsys, lambda: parse_args(FLAGS + argv), words)
