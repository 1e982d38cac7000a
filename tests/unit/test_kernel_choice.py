"""The measured choice of fused path (megatron/fused/choice.py): its cache key, its cache
file (written whole, read by reruns, re-measured once deleted), the read-only fallback,
the timing, and the --fused-kernels-choice override."""
import json
import time

import pytest
import torch

from megatron.fused import choice

OP = "unit_test_op"


@pytest.fixture
def auto(tmp_path, monkeypatch):
    """auto mode with the cache in tmp_path, a fake op, and a timer that records its calls
    and says ours is faster (`timings["ours"], timings["plain"]`)."""
    monkeypatch.setenv(choice.MODE_ENV, "auto")
    monkeypatch.setenv(choice.CACHE_ENV, str(tmp_path / "kc" / "kernel-choice.json"))
    choice.reset()
    choice.register(OP, lambda dims, dtype: (lambda: None, lambda: None),
                    lambda dims, dtype: False, lambda dims: "the plain path")
    timings = {"ours": 1.0, "plain": 2.0, "calls": 0}

    def fake_time_pair(ours, plain):
        timings["calls"] += 1
        return timings["ours"], timings["plain"]
    monkeypatch.setattr(choice, "time_pair", fake_time_pair)
    yield timings
    choice.reset()
    choice.MEASURES.pop(OP, None)


def decision(rows=1000):
    return choice.Decision(OP, "float32", (("rows", choice.bucket(rows)), ("hidden", 64)))


def test_cache_key_names_machine_isa_kernels_threads_dtype_and_bucket(monkeypatch):
    """The key names the kernels' version too: a choice measured against an older kernel
    is not taken for a changed one."""
    from megatron.fused import kernels
    assert [choice.bucket(n) for n in (1, 2, 3, 1000, 1024, 1025)] == [1, 2, 4, 1024, 1024, 2048]
    assert decision(1000) == decision(1024) != decision(1025)
    key = decision().key()
    for part in (kernels.cpu_model(), kernels.cpu_isa(), f"kernels {kernels.cpu_kernels_version()}",
                 f"threads {torch.get_num_threads()}", OP, "float32", "rows1024 hidden64"):
        assert part in key, (part, key)
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    assert decision().key() != key
    monkeypatch.setattr(kernels, "cpu_isa", lambda: "baseline")
    assert "| baseline |" in decision().key()
    monkeypatch.setattr(kernels, "cpu_kernels_version", lambda: "0123456789abcdef")
    assert "| kernels 0123456789abcdef |" in decision().key()


def test_cache_file_written_read_and_remeasured_once_deleted(auto, capsys):
    assert choice.prefer_ours(decision()) and auto["calls"] == 1
    path = choice.cache_path()
    data = json.loads(path.read_text())
    record = data["choices"][decision().key()]
    assert data["version"] == choice.CACHE_VERSION
    assert record["choice"] == "ours" and record["ours_ms"] == 1000.0
    assert record["plain_ms"] == 2000.0 and "measured" in record
    assert not list(path.parent.glob("*.tmp.*"))  # published whole
    assert choice.prefer_ours(decision()) and auto["calls"] == 1  # this process's answer
    out = capsys.readouterr().out
    assert out.count("kernel choice:") == 1 and "measured now" in out and str(path) in out
    choice.reset()  # a rerun: the cache answers, nothing is timed
    auto.update(ours=2.0, plain=1.0)
    assert choice.prefer_ours(decision()) and auto["calls"] == 1
    assert "from the cache" in capsys.readouterr().out
    path.unlink()  # deleting the cache re-measures
    choice.reset()
    assert not choice.prefer_ours(decision()) and auto["calls"] == 2
    assert json.loads(path.read_text())["choices"][decision().key()]["choice"] == "plain"


def test_cache_keeps_other_records_and_ignores_a_broken_file(auto):
    path = choice.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert choice.prefer_ours(decision(10)) and auto["calls"] == 1
    choice.reset()
    assert choice.prefer_ours(decision(5000)) and auto["calls"] == 2
    assert set(json.loads(path.read_text())["choices"]) == {decision(10).key(),
                                                            decision(5000).key()}


def test_unwritable_cache_measures_in_memory_and_says_so_once(auto, tmp_path, monkeypatch,
                                                              capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a directory that cannot be made, even by root
    monkeypatch.setenv(choice.CACHE_ENV, str(blocker / "kernel-choice.json"))
    assert choice.prefer_ours(decision(10)) and choice.prefer_ours(decision(5000))
    assert choice.prefer_ours(decision(10)) and auto["calls"] == 2
    out = capsys.readouterr().out
    assert out.count("is not writable") == 1 and "measuring in memory" in out
    assert "in memory)" in out.splitlines()[-1]


def test_override_modes(auto, monkeypatch, capsys):
    for mode, want in (("ours", True), ("plain", False), ("rule", False)):
        choice.set_mode(mode)
        assert choice.prefer_ours(decision()) is want
    assert auto["calls"] == 0 and not choice.cache_path().exists()
    assert "(--fused-kernels-choice ours)" in capsys.readouterr().out
    with pytest.raises(choice.KernelChoiceError, match="not one of"):
        choice.set_mode("fastest")
    choice.set_mode(None)
    monkeypatch.setenv(choice.MODE_ENV, "fastest")
    with pytest.raises(choice.KernelChoiceError, match="MEGATRON_FUSED_KERNELS_CHOICE"):
        choice.mode()


def test_flag_sets_the_mode_at_model_build(auto):
    from megatron.arguments import parse_args
    from megatron.config import ConfigError, ModelConfig
    from megatron.config.model import KERNEL_CHOICES
    from megatron.training.kernel_choices import agree_kernel_choices
    assert KERNEL_CHOICES == choice.MODES
    flags = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
             "--train-iters", "1", "--lr", "1e-4"]
    config, _ = parse_args(flags + ["--fused-kernels-choice", "plain"], world_size=1)
    assert config.model.fused_kernels_choice == "plain"
    config.model.padded_vocab_size = 128
    assert agree_kernel_choices(config, "cpu") == {} and choice.mode() == "plain"
    assert parse_args(flags, world_size=1)[0].model.fused_kernels_choice is None
    with pytest.raises(SystemExit):
        parse_args(flags + ["--fused-kernels-choice", "fastest"], world_size=1)
    with pytest.raises(ConfigError, match="fused-kernels-choice"):
        ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=32,
                    max_position_embeddings=32, fused_kernels_choice="fastest")


@pytest.mark.parametrize("extra", [[], ["--num-layers", "2", "--position-embedding-type", "rope",
                                         "--attention-chunk-size", "8", "--no-rope-freq", "2"],
                                   ["--num-layers", "2", "--window-size", "8",
                                    "--window-attn-skip-freq", "2", "--softmax-type",
                                    "learnable"], ["--bf16"]],
                         ids=["plain", "llama4-chunks", "gpt-oss-windows-sinks", "bf16"])
def test_planned_decisions_are_those_the_forward_asks(auto, monkeypatch, extra):
    """A model build agrees the decisions its forward then asks: no timing after build (with
    attention chunks: the full causal NoPE layer and the chunks folded into the batch; with
    windows and sinks: the windowed layer's and the full layer's, each with sinks; in bfloat16
    where the kernel has both ways to its products, that decision too)."""
    from functools import partial

    import pretrain_gpt
    from megatron.arguments import parse_args
    from megatron.mpu import model_parallel_seed, single_process_state
    from megatron.training.parallelize import build_model
    config, _ = parse_args(["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads",
                            "4", "--seq-length", "32", "--max-position-embeddings", "32",
                            "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-4",
                            *extra], world_size=1)
    config.model.padded_vocab_size = 128
    pstate = single_process_state()
    model_parallel_seed(1, 0)
    (model,) = build_model(config, pstate, torch.device("cpu"),
                           partial(pretrain_gpt.model_provider, config, pstate.tp_group))
    ops = {d.op for d, _threads in choice._STATE.table}
    built = auto["calls"]
    assert {"attention", "layer_norm", "exp_sum"} <= ops and built >= 3
    tokens, positions = torch.randint(0, 128, (2, 33)), torch.arange(32).expand(2, 32)
    for training in (True, False):
        model.train(training)
        loss = model(tokens[:, :-1], positions, labels=tokens[:, 1:])
        if training:
            loss.sum().backward()
    assert auto["calls"] == built, "the forward asked a decision the build did not plan"
    if "--bf16" in extra:
        from megatron.fused.attention import bf16_brgemm
        assert ("attention_products" in ops) == bf16_brgemm(), ops
    if "--window-size" in extra:
        dims = {tuple(d.dims) for d, _threads in choice._STATE.table if d.op == "attention"}
        assert any(("window", 8) in d and ("sinks", 1) in d for d in dims), dims
        assert any(("sinks", 1) in d and not any(n == "window" for n, _ in d) for d in dims), dims


def test_time_pair_takes_the_faster_of_two_under_interleaving():
    def sleeper(seconds):
        return lambda: time.sleep(seconds)
    fast, slow = choice.time_pair(sleeper(0.001), sleeper(0.004))
    assert fast < slow
    slow, fast = choice.time_pair(sleeper(0.004), sleeper(0.001))
    assert fast < slow


def counted_sleeper(calls):
    """sleeper(name, seconds): a step that sleeps and counts its calls in calls[name]."""
    def sleeper(name, seconds):
        def call():
            calls[name] += 1
            time.sleep(seconds)
        return call
    return sleeper


def test_time_pair_stops_at_a_clear_winner_of_the_warm_ups(monkeypatch):
    """A warm-up call long enough and several times the other's decides alone (a bfloat16
    SDPA with a window's mask takes seconds); closer ones go on to the interleaved rounds."""
    calls = {"fast": 0, "slow": 0}
    sleeper = counted_sleeper(calls)
    monkeypatch.setattr(choice, "CLEAR_WIN_S", 0.02)
    fast, slow = choice.time_pair(sleeper("fast", 0.005), sleeper("slow", 0.03))
    assert fast < slow and calls == {"fast": 1, "slow": 1}
    calls.update(fast=0, slow=0)
    choice.time_pair(sleeper("fast", 0.015), sleeper("slow", 0.03))
    assert calls["fast"] > 1 and calls["slow"] > 1


def test_time_pair_takes_more_rounds_where_the_two_are_close():
    """Three rounds (a long shape) whose medians are within CLOSE_RATIO go on to MAX_REPEATS;
    a clear difference stops at three."""
    calls = {"a": 0, "b": 0}
    sleeper = counted_sleeper(calls)
    choice.time_pair(sleeper("a", 0.02), sleeper("b", 0.02))
    assert calls == {"a": 1 + choice.MAX_REPEATS, "b": 1 + choice.MAX_REPEATS}
    calls.update(a=0, b=0)
    choice.time_pair(sleeper("a", 0.02), sleeper("b", 0.06))
    assert calls == {"a": 1 + choice.MIN_REPEATS, "b": 1 + choice.MIN_REPEATS}


@pytest.mark.parametrize("plain, taken", [(1.02, "plain"), (1.2, "ours")])
def test_a_tie_takes_the_rule_and_says_so(auto, capsys, plain, taken):
    """Within TIE_RATIO the op's rule decides (the fake op's rule: plain), recorded as a tie;
    a clear difference takes the faster."""
    auto.update(ours=1.0, plain=plain)
    assert choice.prefer_ours(decision()) == (taken == "ours")
    record = json.loads(choice.cache_path().read_text())["choices"][decision().key()]
    assert record["choice"] == taken and record.get("tie", False) == (taken == "plain")
    said = "a tie, the rule's path" in capsys.readouterr().out
    assert said == (taken == "plain")


def test_a_timing_at_first_use_leaves_rng_and_grad_mode_alone(auto, monkeypatch):
    """First use inside evaluation (no_grad) times forward+backward all the same, and the
    random stream after it is the one a run that read the cache would see."""
    from megatron.fused.norms import norm_decision
    monkeypatch.setattr(choice, "time_pair", lambda ours, plain: (ours(), plain(), 1.0, 2.0)[2:])
    x = torch.randn(64, 32)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    with torch.no_grad():
        assert choice.prefer_ours(norm_decision("layer_norm", x))
    assert torch.equal(torch.rand(3), expected)
