"""Acceptance of issue 11: the Megatron-style launch scripts in examples/ (the README's
"Coming from Megatron-LM / Megatron-DeepSpeed" commands) get through pretrain_gpt's parsing
and set-up at the world size their launcher creates.

Each script runs with `python`, `torchrun` and `deepspeed` replaced by stubs that record
their arguments; the recorded pretrain_gpt.py flags then go through `pretrain_gpt.setup`
(flags, DeepSpeed JSON, layout checks, tokenizer) with WORLD_SIZE set as the launcher would.
"""
import pytest

import pretrain_gpt
from tests.conftest import ROOT
from tests.data_setup import bpe_dir
from tests.unit.test_examples import launcher_world_size, recorded_launch

COMPAT_SCRIPTS = {"megatron_deepspeed_gpt2.sh": 8, "deepspeed_zero1_gpt.sh": 8,
                  "megatron_lm_gpt_recompute.sh": 8}


@pytest.mark.parametrize("script", sorted(COMPAT_SCRIPTS))
def test_megatron_style_scripts_parse_and_set_up(tmp_path, monkeypatch, capsys, script):
    args = recorded_launch(tmp_path, script, VOCAB=str(bpe_dir() / "vocab.json"),
                           MERGE=str(bpe_dir() / "merges.txt"), CHECKPOINTS=str(tmp_path / "ckpt"))
    split = args.index("pretrain_gpt.py")
    launcher, flags = args[:split], args[split + 1:]
    assert launcher_world_size(launcher) == COMPAT_SCRIPTS[script]
    monkeypatch.chdir(ROOT)  # the scripts cd to the repository (ds_config path)
    monkeypatch.setenv("WORLD_SIZE", str(launcher_world_size(launcher)))
    monkeypatch.setenv("RANK", "0")
    config, tokenizer = pretrain_gpt.setup(flags)
    assert config.data.tokenizer_type == "GPT2BPETokenizer" and tokenizer.vocab_size > 0
    if script == "deepspeed_zero1_gpt.sh":
        assert config.parallel.use_distributed_optimizer and config.training.fp16
        assert config.optimizer.initial_loss_scale == 2.0 ** 12
    if script == "megatron_lm_gpt_recompute.sh":
        assert (config.model.recompute_granularity, config.model.recompute_method,
                config.model.attention_impl, config.parallel.DDP_impl) == \
            ("full", "uniform", "sdpa", "local")
        assert "--DDP-impl local" in capsys.readouterr().out


def test_readme_shows_the_compat_commands():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Coming from Megatron-LM / Megatron-DeepSpeed"):]
    for script in COMPAT_SCRIPTS:
        assert f"examples/{script}" in section
    for flag in ("--deepspeed_config", "--recompute-method", "--separate-last-epoch-threshold",
                 "--universal-checkpoint", "Llama2Tokenizer"):
        assert flag in section
