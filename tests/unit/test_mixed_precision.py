"""fp16 with dynamic loss scaling and bf16, on the CPU."""
import re

import pytest
import torch

import pretrain_gpt
from megatron.training import trainer as trainer_module
from tests.gpt_setup import losses, preprocess_wiki, tiny_gpt_argv



@pytest.fixture(scope="module")
def wiki(tmp_path_factory):
    out = tmp_path_factory.mktemp("wiki")
    return preprocess_wiki(out), out / "cache"


def test_fp16_skips_a_step_with_inf_gradients_and_halves_the_scale(wiki, monkeypatch, capsys):
    prefix, cache = wiki
    real = trainer_module.allreduce_embedding_grads
    calls = {"n": 0}

    def inject_inf(models, pstate):
        real(models, pstate)
        calls["n"] += 1
        if calls["n"] == 3:  # the third step gets an overflowing gradient
            next(p for p in models[0].parameters()).main_grad.view(-1)[0] = float("inf")

    monkeypatch.setattr(trainer_module, "allreduce_embedding_grads", inject_inf)
    state = pretrain_gpt.main(tiny_gpt_argv(prefix, cache, "--fp16", "--initial-loss-scale", "1024",
                                            "--hysteresis", "1", iters=5))
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith(" iteration ")]
    scales = [float(re.search(r"loss scale: ([0-9.]+)", l).group(1)) for l in lines]
    skipped = [int(re.search(r"skipped iterations: +(\d+)", l).group(1)) for l in lines]
    lrs = [float(re.search(r"learning rate: ([0-9.E+-]+)", l).group(1)) for l in lines]
    assert skipped == [0, 0, 1, 0, 0]
    assert scales == [1024.0, 1024.0, 512.0, 512.0, 512.0]
    curve = losses(state)
    assert all(torch.isfinite(torch.tensor(curve)))
    assert lrs[2] == lrs[1] and lrs[3] != lrs[2]  # the skipped step did not advance the schedule


@pytest.mark.parametrize("flag, tol", [("--bf16", 2e-2), ("--fp16", 2e-3)])
def test_half_precision_tracks_fp32(wiki, flag, tol):
    prefix, cache = wiki
    reference = losses(pretrain_gpt.main(tiny_gpt_argv(prefix, cache, iters=6)))
    half = losses(pretrain_gpt.main(tiny_gpt_argv(prefix, cache, flag, "--initial-loss-scale", "4096",
                                                  iters=6)))
    assert half == pytest.approx(reference, rel=tol)
    assert half[-1] < half[0]
