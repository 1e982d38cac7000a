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
import os
from dataclasses import dataclass, field
from typing import List

import pytest

from megatron.mpu.topology import ParallelDims
from tests.distributed.run_ranks import run_ranks
from tests.gpt_setup import have_reference_data, losses, one_thread, preprocess_wiki, tiny_gpt_argv

pytestmark = pytest.mark.skipif(not have_reference_data(), reason="../shared/data not available")

ITERS = 10
SAVE_AT = 5
LOSS_TOL = 1e-5
GLOBAL_BATCH = 8


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    mbs: int
    extra: List[str] = field(default_factory=list)
    resume: bool = False  # also save at SAVE_AT and resume to ITERS

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_micro_batches(self) -> int:
        return GLOBAL_BATCH // (self.dp * self.mbs)

    def argv(self, data_prefix, cache_dir, *more):
        return tiny_gpt_argv(data_prefix, cache_dir, "--tensor-model-parallel-size", str(self.tp),
                             "--pipeline-model-parallel-size", str(self.pp), *self.extra, *more,
                             mbs=self.mbs, gbs=GLOBAL_BATCH, iters=ITERS)

    def is_last_stage(self, rank: int) -> bool:
        pp_rank, _, _ = ParallelDims(world_size=self.world, tp=self.tp, pp=self.pp).coordinates(rank)
        return pp_rank == self.pp - 1


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


def _layouts_of_world(world):
    return {name: layout for name, layout in LAYOUTS.items() if layout.world == world}


def _train(argv):
    import pretrain_gpt
    state = pretrain_gpt.main(argv)
    return {"losses": losses(state), "iterations": [h["iteration"] for h in state.history]}


def _rank(rank, world_size, data_prefix, workdir):
    """Every layout of this world size in turn; resumable ones also save and resume."""
    cache = os.path.join(workdir, f"cache-{world_size}")
    results = {}
    for name, layout in _layouts_of_world(world_size).items():
        results[name] = _train(layout.argv(data_prefix, cache))
        if layout.resume:
            save = os.path.join(workdir, f"ckpt-{name}")
            results[name + "/first"] = _train(layout.argv(
                data_prefix, cache, "--save", save, "--save-interval", str(SAVE_AT),
                "--exit-interval", str(SAVE_AT)))
            results[name + "/resumed"] = _train(layout.argv(data_prefix, cache, "--load", save))
    return results


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts")
    return preprocess_wiki(out), out


@pytest.fixture(scope="module")
def reference(workdir):
    """(TP, PP, DP) = (1, 1, 1) in the pytest process (one thread, like each rank)."""
    import pretrain_gpt
    prefix, out = workdir
    with one_thread():
        state = pretrain_gpt.main(tiny_gpt_argv(prefix, out / "cache-ref", mbs=2, gbs=GLOBAL_BATCH,
                                                iters=ITERS))
    return losses(state)


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


def assert_close(got, want, what):
    assert len(got) == len(want), f"{what}: {len(got)} losses, expected {len(want)}"
    rel = [abs(a - b) / abs(b) for a, b in zip(got, want)]
    assert max(rel) < LOSS_TOL, f"{what}: max relative difference {max(rel):.3g}\n{got}\n{want}"


def test_layout_table_is_consistent():
    for name, layout in LAYOUTS.items():
        assert layout.dp * layout.mbs * layout.num_micro_batches == GLOBAL_BATCH, name
        if layout.extra[:1] == ["--num-layers-per-virtual-pipeline-stage"]:
            assert layout.num_micro_batches % layout.pp == 0, name
    assert {layout.mbs for layout in LAYOUTS.values()} == {1, 2, 4}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_losses_equal_one_device(name, reference, request):
    layout = LAYOUTS[name]
    results = spawn(layout.world, request)
    assert len(reference) == ITERS
    for rank, result in enumerate(results):
        got = result[name]
        if layout.is_last_stage(rank):
            assert got["iterations"] == list(range(1, ITERS + 1)), f"rank {rank}"
            assert_close(got["losses"], reference, f"{name} rank {rank}")
        else:
            assert got["losses"] == [], f"rank {rank} is not on the last stage but reported losses"


@pytest.mark.parametrize("name", [n for n, layout in LAYOUTS.items() if layout.resume])
def test_checkpoint_resumes_exactly(name, workdir, request):
    layout = LAYOUTS[name]
    results = spawn(layout.world, request)
    _, out = workdir
    save = out / f"ckpt-{name}"
    assert (save / "latest_checkpointed_iteration.txt").read_text() == str(SAVE_AT)
    folders = sorted(os.listdir(save / f"iter_{SAVE_AT:07d}"))
    if layout.pp == 1:
        assert folders == ["mp_rank_00"], folders
    else:
        assert folders == [f"mp_rank_00_{p:03d}" for p in range(layout.pp)], folders
    for rank, result in enumerate(results):
        if not layout.is_last_stage(rank):
            continue
        full, first, resumed = result[name], result[name + "/first"], result[name + "/resumed"]
        assert first["iterations"] == list(range(1, SAVE_AT + 1)), f"rank {rank}"
        assert first["losses"] == full["losses"][:SAVE_AT], f"rank {rank}"
        assert resumed["iterations"] == list(range(SAVE_AT + 1, ITERS + 1)), f"rank {rank}"
        assert resumed["losses"] == full["losses"][SAVE_AT:], f"rank {rank}: resumed run differs"
