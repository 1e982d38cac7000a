"""Distributed-optimizer checkpoints do not depend on context parallelism.

The distributed optimizer shards over DP x CP (Megatron-Core's group), so a run at CP 2 x
DP 2 holds four shards, as DP 4 does. Saved at iteration 5 at CP 2 x DP 2 (in the torch
and the torch_dist format), it resumes without any flag at CP 4 and at CP 1 x DP 4 (one
spawn of 4 ranks) and in one process (no flag but the format's), each with the losses of an uninterrupted run at
that layout within 1e-5 relative. A LLaMA-style model (as in
test_context_parallel_layouts.py) at seq 128.
"""
import os

import pytest

from tests.distributed import layouts as L
from tests.distributed.run_ranks import run_ranks
from tests.gpt_setup import losses, one_thread, tiny_gpt_argv, wiki_workdir


SEQ = 128
MODEL = L.llama_style(SEQ) + ["--use-distributed-optimizer"]
SAVED = L.Layout(1, 1, 2, mbs=2, cp=2, extra=MODEL)
TARGETS = {"cp4": L.Layout(1, 1, 1, mbs=2, cp=4, extra=MODEL),
           "cp1-dp4": L.Layout(1, 1, 4, mbs=2, extra=MODEL)}
FORMATS = ("torch", "torch_dist")


def _save_dir(workdir, fmt):
    return os.path.join(workdir, f"ckpt-cp2-dp2-{fmt}")


def _rank(rank, world_size, data_prefix, workdir):
    cache = os.path.join(workdir, "cache-4")
    results = {}
    for fmt in FORMATS:
        results[f"saved/{fmt}"] = L.train(SAVED.argv(
            data_prefix, cache, "--ckpt-format", fmt, "--save", _save_dir(workdir, fmt),
            "--save-interval", str(L.SAVE_AT), "--exit-interval", str(L.SAVE_AT)))
    for name, layout in TARGETS.items():
        results[name] = L.train(layout.argv(data_prefix, cache))
        for fmt in FORMATS:
            results[f"{name}/{fmt}"] = L.train(layout.argv(
                data_prefix, cache, "--ckpt-format", fmt, "--load", _save_dir(workdir, fmt)))
    return results


workdir = wiki_workdir("cp-resume")


@pytest.fixture(scope="module")
def spawn(workdir):
    prefix, out = workdir
    return run_ranks(_rank, 4, prefix, str(out), timeout=1500)


def test_cp2_dp2_saves_the_shards_of_dp4(workdir, spawn):
    """Four optimizer shards, one per DP x CP rank; the model file once."""
    folder = os.path.join(_save_dir(str(workdir[1]), "torch"), f"iter_{L.SAVE_AT:07d}",
                          "mp_rank_00")
    assert sorted(f for f in os.listdir(folder) if f.endswith(".pt")) == ["distrib_optim_dp_000.pt", "distrib_optim_dp_001.pt",
                                          "distrib_optim_dp_002.pt", "distrib_optim_dp_003.pt",
                                          "model_optim_rng.pt"]


def test_torch_dist_keeps_one_rng_state_per_cp_rank(workdir, spawn):
    from megatron.checkpointing.megatron_legacy import safe_load
    common = safe_load(os.path.join(_save_dir(str(workdir[1]), "torch_dist"),
                                    f"iter_{L.SAVE_AT:07d}", "common.pt"))
    assert sorted(common["rng_state"]) == [f"tp000_pp000_dp{d:03d}_cp{c:03d}"
                                           for d in range(2) for c in range(2)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("target", list(TARGETS))
def test_resumes_at_another_cp_size(spawn, target, fmt):
    for rank, result in enumerate(spawn):
        assert result[f"saved/{fmt}"]["iterations"] == list(range(1, L.SAVE_AT + 1))
        resumed, full = result[f"{target}/{fmt}"], result[target]
        assert resumed["iterations"] == list(range(L.SAVE_AT + 1, L.ITERS + 1)), f"rank {rank}"
        L.assert_close(resumed["losses"], full["losses"][L.SAVE_AT:],
                       f"CP 2 x DP 2 ({fmt}) resumed at {target}, rank {rank}")
    got, want = spawn[-1][f"{target}/{fmt}"]["losses"], spawn[-1][target]["losses"][L.SAVE_AT:]
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    print(f"CP 2 x DP 2 ({fmt}) resumed at {target}: max relative difference {worst:.2e}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_resumes_in_one_process(workdir, spawn, fmt):
    import pretrain_gpt
    prefix, out = workdir
    with one_thread():
        full = pretrain_gpt.main(tiny_gpt_argv(prefix, out / "cache-1", *MODEL, mbs=2,
                                               gbs=L.GLOBAL_BATCH, iters=L.ITERS))
        resumed = pretrain_gpt.main(tiny_gpt_argv(
            prefix, out / "cache-1", *MODEL, "--ckpt-format", fmt, "--load",
            _save_dir(str(out), fmt), mbs=2, gbs=L.GLOBAL_BATCH, iters=L.ITERS))
    L.assert_close(losses(resumed), losses(full)[L.SAVE_AT:], f"resumed ({fmt}) at CP 1")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses(resumed), losses(full)[L.SAVE_AT:]))
    print(f"CP 2 x DP 2 ({fmt}) resumed in one process: max relative difference {worst:.2e}")
