"""Flexible pipeline layouts train like one device (issue 30, item 3).

A 3-layer tiny GPT over PP 2 (one spawn of 2 ranks) split by --pipeline-model-parallel-layout
("Ett|tL"; "E|tttL", whose first rank holds only the embedding; PP 2 x VP 2 from "Et|t||tL",
with an empty chunk, and from "Et|t|t|L", whose last chunk holds only the loss) and by
--decoder-first/last-pipeline-num-layers gives the losses and gradient norms of one
process within 1e-5 relative over 10 iterations. The torch-format checkpoint of the layout
with an empty chunk resumes bit for bit; a torch_dist checkpoint saved at iteration 5
under "Ett|tL" reloads under "Et|ttL", under "Et|t|t|L" (PP 2 x VP 2) and at plain PP 1 x
DP 2: the first resumed loss (the reloaded weights' forward) equals the uninterrupted run's
bit for bit at PP 2, and every resumed loss is within 1e-5. --universal-checkpoint re-shards
the torch-format checkpoint of "Et|t||tL" to "Et|ttL" with the same weights.
"""
import os

import pytest

from tests.distributed.layouts import (ITERS, SAVE_AT, Layout, assert_close, check_losses,
                                       check_resume, checkpoint_dir, reference_run, train,
                                       train_layouts)
from tests.distributed.run_ranks import run_ranks
from tests.gpt_setup import wiki_workdir

THREE = ["--num-layers", "3"]
LAYOUT = "--pipeline-model-parallel-layout"


def _pp2(*flags, mbs=2, resume=False):
    return Layout(1, 2, 1, mbs=mbs, extra=THREE + list(flags), resume=resume)


LAYOUTS = {
    "Ett|tL": _pp2(LAYOUT, "Ett|tL"),
    "E|tttL": _pp2(LAYOUT, "E|tttL"),
    "Et|t||tL": _pp2(LAYOUT, "Et|t||tL", mbs=1, resume=True),
    "Et|t|t|L": _pp2(LAYOUT, "Et|t|t|L", mbs=1),
    "decoder-first-1": _pp2("--decoder-first-pipeline-num-layers", "1"),
    "decoder-last-1": _pp2("--decoder-last-pipeline-num-layers", "1"),
}
RELOADS = {  # loaded from the torch_dist checkpoint saved under "Ett|tL"
    "Et|ttL": _pp2(LAYOUT, "Et|ttL"),
    "Et|t|t|L": _pp2(LAYOUT, "Et|t|t|L"),
    "pp1-dp2": Layout(1, 1, 2, mbs=1, extra=THREE),
}
DIST = ["--ckpt-format", "torch_dist"]


def _rank(rank, world_size, data_prefix, workdir):
    results = train_layouts(LAYOUTS, world_size, data_prefix, workdir)
    cache, save = os.path.join(workdir, "cache-2"), os.path.join(workdir, "ckpt-dist")
    results["saved"] = train(LAYOUTS["Ett|tL"].argv(
        data_prefix, cache, *DIST, "--save", save, "--save-interval", str(SAVE_AT),
        "--exit-interval", str(SAVE_AT)))
    for name, layout in RELOADS.items():
        results["reload " + name] = train(layout.argv(data_prefix, cache, *DIST, "--load", save))
    results["universal"] = train(_pp2(LAYOUT, "Et|ttL", mbs=1).argv(
        data_prefix, cache, "--universal-checkpoint", "--load",
        checkpoint_dir(workdir, "Et|t||tL")))
    return results


workdir = wiki_workdir("pipeline-layouts")


@pytest.fixture(scope="module")
def reference(workdir):
    prefix, out = workdir
    return reference_run(prefix, out / "cache-ref", *THREE)


@pytest.fixture(scope="module")
def spawn2(workdir):
    prefix, out = workdir
    return run_ranks(_rank, 2, prefix, str(out), timeout=1200)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_losses_equal_one_device(name, reference, spawn2):
    check_losses(name, LAYOUTS[name], spawn2, reference)


def test_a_layout_with_an_empty_chunk_resumes_exactly(workdir, spawn2):
    check_resume("Et|t||tL", LAYOUTS["Et|t||tL"], spawn2, workdir[1])


def test_the_checkpoint_holds_each_chunk_as_the_layout_places_it(workdir, spawn2):
    from megatron.checkpointing.model_file import from_megatron_layout, read_model_file
    iteration = os.path.join(checkpoint_dir(workdir[1], "Et|t||tL"), f"iter_{SAVE_AT:07d}")

    def part(name):  # "layers.N" or the module holding the tensor
        return ".".join(name.split(".")[2:4]) if ".layers." in name else name.split(".")[-2]

    held = {}
    for p in range(2):
        state = read_model_file(os.path.join(iteration, f"mp_rank_00_{p:03d}",
                                             "model_optim_rng.pt"))
        assert state["parallel"]["pipeline_layout"] == "Et|t||tL"
        for v in range(2):
            held[p, v] = sorted({part(n) for n in from_megatron_layout(state[f"model{v}"])})
    assert held == {(0, 0): ["layers.0", "position_embeddings", "word_embeddings"], (0, 1): [],
                    (1, 0): ["layers.0"],
                    (1, 1): ["final_layernorm", "layers.0", "word_embeddings_for_head"]}, held


@pytest.mark.parametrize("name", list(RELOADS))
def test_torch_dist_saved_under_a_layout_reloads_at_another(name, spawn2):
    layout = RELOADS[name]
    full = spawn2[1]["Ett|tL"]["losses"]
    assert spawn2[1]["saved"]["losses"] == full[:SAVE_AT]
    for rank, result in enumerate(spawn2):
        got = result["reload " + name]
        if not layout.is_last_stage(rank):
            assert got["losses"] == [], f"rank {rank}"
            continue
        assert got["iterations"] == list(range(SAVE_AT + 1, ITERS + 1)), f"rank {rank}"
        assert_close(got["losses"], full[SAVE_AT:], f"{name} rank {rank}")
        if layout.pp == 2:  # the same micro batches: the same sums
            assert got["losses"][0] == full[SAVE_AT], f"{name}: the reloaded weights differ"


def test_the_torch_format_saved_under_a_layout_re_shards_to_another(spawn2):
    """--universal-checkpoint reads the chunks of "Et|t||tL" back by their layer counts and
    cuts them for "Et|ttL": the first loss is the uninterrupted run's (the optimizer
    starts fresh, so only the weights carry over)."""
    got, full = spawn2[1]["universal"], spawn2[1]["Et|t||tL"]["losses"]
    assert got["iterations"] == list(range(SAVE_AT + 1, ITERS + 1))
    assert got["losses"][0] == full[SAVE_AT]
    assert spawn2[0]["universal"]["losses"] == []
