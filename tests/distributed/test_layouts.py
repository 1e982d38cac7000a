"""Every (TP, PP, DP) layout trains like one device, and checkpoints resume exactly.

With --use-cpu-initialization, dropout 0 and one seed, 10 iterations of the tiny
GPT give the losses of (TP, PP, DP) = (1, 1, 1) (computed in the pytest process)
within 1e-5 relative, for every layout below. Micro batch sizes vary so that
DP x micro batch x micro batches = 8, the global batch. PP = 2 with full
recomputation, TP = PP = 2 with sequence parallelism and DP = 2 with
--use-distributed-optimizer are checked the same way. Checkpoints saved at
iteration 5 with PP = 2, DP = 2, DP = 2 with the distributed optimizer and
PP = DP = 2 with the distributed optimizer and overlapped reduction resume to
the uninterrupted losses bit for bit. Three spawns: 2, 4 and 8 ranks.
"""
import pytest

from tests.distributed.layouts import (GLOBAL_BATCH, Layout, check_losses, check_resume,
                                       reference_run, train_layouts)
from tests.distributed.run_ranks import run_ranks
from tests.gpt_setup import wiki_workdir



LAYOUTS = {
    "pp2": Layout(1, 2, 1, mbs=2, resume=True),
    "dp2": Layout(1, 1, 2, mbs=1, resume=True),
    "pp2-interleaved": Layout(1, 2, 1, mbs=1, extra=["--num-layers-per-virtual-pipeline-stage", "1"]),
    "pp4": Layout(1, 4, 1, mbs=1),
    "tp2-pp2": Layout(2, 2, 1, mbs=4),
    "tp2-dp2": Layout(2, 1, 2, mbs=1),
    "pp2-dp2": Layout(1, 2, 2, mbs=2),
    "tp2-pp2-dp2": Layout(2, 2, 2, mbs=1),
    # beyond the plain layouts: recomputation and sequence parallelism under pipelining
    "pp2-checkpoint-activations": Layout(1, 2, 1, mbs=4, extra=["--checkpoint-activations"]),
    "tp2-pp2-sequence-parallel": Layout(2, 2, 1, mbs=2, extra=["--sequence-parallel"]),
    "dp2-distributed-optimizer": Layout(1, 1, 2, mbs=2, extra=["--use-distributed-optimizer"],
                                        resume=True),
    # many small buckets reduced during backward; the tied embeddings' buckets wait for
    # the embedding all-reduce
    "pp2-dp2-distributed-optimizer-overlap": Layout(
        1, 2, 2, mbs=2, extra=["--use-distributed-optimizer", "--overlap-grad-reduce",
                               "--ddp-bucket-size", "20000"], resume=True),
}


def _rank(rank, world_size, data_prefix, workdir):
    return train_layouts(LAYOUTS, world_size, data_prefix, workdir)


workdir = wiki_workdir("layouts")


@pytest.fixture(scope="module")
def reference(workdir):
    prefix, out = workdir
    return reference_run(prefix, out / "cache-ref")


def _spawn(world, workdir):
    prefix, out = workdir
    return run_ranks(_rank, world, prefix, str(out), timeout=900)


@pytest.fixture(scope="module")
def spawn2(workdir):
    return _spawn(2, workdir)


@pytest.fixture(scope="module")
def spawn4(workdir):
    return _spawn(4, workdir)


@pytest.fixture(scope="module")
def spawn8(workdir):
    return _spawn(8, workdir)


def spawn(world, request):
    """Per-rank results of the one spawn of `world` ranks (run on first use)."""
    return request.getfixturevalue(f"spawn{world}")


def test_layout_table_is_consistent():
    for name, layout in LAYOUTS.items():
        assert layout.dp * layout.mbs * layout.num_micro_batches == GLOBAL_BATCH, name
        if layout.extra[:1] == ["--num-layers-per-virtual-pipeline-stage"]:
            assert layout.num_micro_batches % layout.pp == 0, name
    assert {layout.mbs for layout in LAYOUTS.values()} == {1, 2, 4}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_losses_equal_one_device(name, reference, request):
    layout = LAYOUTS[name]
    check_losses(name, layout, spawn(layout.world, request), reference)


@pytest.mark.parametrize("name", [n for n, layout in LAYOUTS.items() if layout.resume])
def test_checkpoint_resumes_exactly(name, workdir, request):
    layout = LAYOUTS[name]
    check_resume(name, layout, spawn(layout.world, request), workdir[1])
