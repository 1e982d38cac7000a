"""--ckpt-format torch_dist re-shards at load, optimizer state included (issue 20).

For the GPT, LLaMA-style and BLOOM-style configs: 5 iterations at TP 2 x PP 2 with the
distributed optimizer are saved in torch_dist, then resumed at TP 1 x PP 4, TP 4 x PP 1,
DP 2 x TP 2 (distributed optimizer) and PP 2 x VP 2; iterations 6-10 of each resumption
give the losses of an uninterrupted 10-iteration run at that layout within 1e-5 (the fresh
optimizer state of --universal-checkpoint would not). One spawn of 4 gloo ranks.
"""
import json
import os

import pytest

from tests.distributed.layouts import ITERS, SAVE_AT, Layout, assert_close, train
from tests.distributed.run_ranks import run_ranks
from tests.distributed.test_spec_layouts import ARCHS
from tests.gpt_setup import preprocess_wiki


DIST = ["--ckpt-format", "torch_dist"]
SAVED = Layout(2, 2, 1, mbs=2, extra=["--use-distributed-optimizer"])
TARGETS = {
    "tp1-pp4": Layout(1, 4, 1, mbs=2),
    "tp4-pp1": Layout(4, 1, 1, mbs=2),
    "dp2-tp2": Layout(2, 1, 2, mbs=2, extra=["--use-distributed-optimizer"]),
    "pp2-vp2": Layout(1, 2, 2, mbs=1, extra=["--num-layers-per-virtual-pipeline-stage", "1"]),
}
CONFIGS = {"gpt": [], "llama": ARCHS["llama"], "bloom": ARCHS["bloom"]}


def _with(layout: Layout, flags) -> Layout:
    return Layout(layout.tp, layout.pp, layout.dp, layout.mbs, list(flags) + layout.extra)


def _rank(rank, world_size, prefix, workdir):
    cache = os.path.join(workdir, "cache")
    out = {}
    for arch, flags in CONFIGS.items():
        save = os.path.join(workdir, f"ckpt-{arch}")
        first = train(_with(SAVED, flags).argv(prefix, cache, *DIST, "--save", save,
                                               "--save-interval", str(SAVE_AT),
                                               "--exit-interval", str(SAVE_AT)))
        out[f"{arch}/first"] = first
        for name, layout in TARGETS.items():
            target = _with(layout, flags)
            out[f"{arch}/{name}"] = train(target.argv(prefix, cache))
            out[f"{arch}/{name}/resumed"] = train(target.argv(prefix, cache, *DIST, "--load",
                                                              save))
    return out


@pytest.fixture(scope="module")
def spawn4(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch-dist")
    prefix = preprocess_wiki(out, docs=40)
    return run_ranks(_rank, 4, prefix, str(out), timeout=1800), out


def _last_stage_result(results, layout: Layout, key):
    ranks = [r for r in range(layout.world) if layout.is_last_stage(r)]
    return [results[r][key] for r in ranks]


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_torch_dist_files(arch, spawn4):
    results, out = spawn4
    folder = os.path.join(str(out), f"ckpt-{arch}", f"iter_{SAVE_AT:07d}")
    names = sorted(os.listdir(folder))
    assert {".metadata", "common.pt", "metadata.json", "checksums.sha256"} <= set(names), names
    assert [n for n in names if n.endswith(".distcp")] == [f"__{r}_0.distcp" for r in range(4)]
    with open(os.path.join(folder, "metadata.json")) as f:
        assert json.load(f)["sharded_backend"] == "torch_dist"
    with open(os.path.join(str(out), f"ckpt-{arch}", "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == str(SAVE_AT)


@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize("name", list(TARGETS))
def test_torch_dist_resumes_at_another_layout(arch, name, spawn4):
    results, _ = spawn4
    layout = TARGETS[name]
    for full, resumed in zip(_last_stage_result(results, layout, f"{arch}/{name}"),
                             _last_stage_result(results, layout, f"{arch}/{name}/resumed")):
        assert full["iterations"] == list(range(1, ITERS + 1))
        assert resumed["iterations"] == list(range(SAVE_AT + 1, ITERS + 1))
        assert_close(resumed["losses"], full["losses"][SAVE_AT:], f"{arch} {name} resumed")
