"""Machinery of the layout tests: a (TP, PP, DP[, CP]) layout of the tiny GPT run, training
every layout of one world size in one spawn, and the loss / resume checks.

With --use-cpu-initialization, dropout 0 and one seed, 10 iterations at any layout
give the losses of (TP, PP, DP) = (1, 1, 1) within 1e-5 relative; checkpoints saved
at iteration 5 resume to the uninterrupted losses bit for bit.
"""
import os
from dataclasses import dataclass, field
from typing import Dict, List

from megatron.mpu.topology import ParallelDims
from tests.gpt_setup import losses, one_thread, tiny_gpt_argv

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
    keep: bool = False  # save the model at ITERS (in ckpt-final-<name>)
    cp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def num_micro_batches(self) -> int:
        return GLOBAL_BATCH // (self.dp * self.mbs)

    def argv(self, data_prefix, cache_dir, *more):
        cp = ["--context-parallel-size", str(self.cp)] if self.cp > 1 else []
        return tiny_gpt_argv(data_prefix, cache_dir, "--tensor-model-parallel-size", str(self.tp),
                             "--pipeline-model-parallel-size", str(self.pp), *cp, *self.extra,
                             *more, mbs=self.mbs, gbs=GLOBAL_BATCH, iters=ITERS)

    def is_last_stage(self, rank: int) -> bool:
        dims = ParallelDims(world_size=self.world, tp=self.tp, pp=self.pp, cp=self.cp)
        return dims.coordinates(rank)[0] == self.pp - 1


def llama_style(seq: int) -> list:
    """The LLaMA-style model of the context-parallel tests (RoPE, RMSNorm, SwiGLU, GQA with
    2 groups, untied head; hidden 32, 2 layers) at sequence length `seq`."""
    return ["--use-rotary-position-embeddings", "--normalization", "RMSNorm", "--swiglu",
            "--group-query-attention", "--num-query-groups", "2",
            "--untie-embeddings-and-output-weights", "--disable-bias-linear",
            "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", str(seq), "--max-position-embeddings", str(seq)]


MOE_FIELDS = ("load_balancing_loss", "z_loss", "tokens-per-expert max/mean")
"""The MoE fields of the log line (present in a run's history when the model has them)."""


def _result(state) -> dict:
    return {"losses": losses(state), "iterations": [h["iteration"] for h in state.history],
            "grad norms": [h.get("grad norm") for h in state.history],
            "moe": [{k: h[k] for k in MOE_FIELDS if k in h} for h in state.history],
            "mtp": [{k: v for k, v in h.items() if k.startswith("mtp_")} for h in state.history]}


def train(argv):
    import pretrain_gpt
    return _result(pretrain_gpt.main(argv))


def reference_run(data_prefix, cache_dir, *extra) -> dict:
    """(TP, PP, DP) = (1, 1, 1) in this process (one thread, like each rank): losses,
    iterations and the MoE fields per iteration."""
    import pretrain_gpt
    with one_thread():
        return _result(pretrain_gpt.main(tiny_gpt_argv(data_prefix, cache_dir, *extra, mbs=2,
                                                       gbs=GLOBAL_BATCH, iters=ITERS)))


def reference_losses(data_prefix, cache_dir, *extra):
    return reference_run(data_prefix, cache_dir, *extra)["losses"]


def checkpoint_dir(workdir, name: str, final: bool = False) -> str:
    safe = name.replace("/", "-")
    return os.path.join(str(workdir), f"ckpt-final-{safe}" if final else f"ckpt-{safe}")


def train_layouts(layouts: Dict[str, Layout], world_size, data_prefix, workdir):
    """Every layout of this world size in turn (in a spawned rank); resumable ones also
    save and resume. Returns {name: result, name/first: ..., name/resumed: ...}."""
    cache = os.path.join(str(workdir), f"cache-{world_size}")
    results = {}
    for name, layout in layouts.items():
        if layout.world != world_size:
            continue
        keep = (["--save", checkpoint_dir(workdir, name, final=True), "--save-interval",
                 str(ITERS)] if layout.keep else [])
        results[name] = train(layout.argv(data_prefix, cache, *keep))
        if layout.resume:
            save = checkpoint_dir(workdir, name)
            results[name + "/first"] = train(layout.argv(
                data_prefix, cache, "--save", save, "--save-interval", str(SAVE_AT),
                "--exit-interval", str(SAVE_AT)))
            results[name + "/resumed"] = train(layout.argv(data_prefix, cache, "--load", save))
    return results


def spawn_worlds(rank_fn, layouts: Dict[str, Layout], data_prefix, workdir,
                 timeout: int = 1800) -> Dict[int, list]:
    """{world size: per-rank results of `rank_fn(rank, world, data_prefix, workdir)`}, one
    spawn per world size the layouts need."""
    from tests.distributed.run_ranks import run_ranks
    return {world: run_ranks(rank_fn, world, data_prefix, str(workdir), timeout=timeout)
            for world in sorted({layout.world for layout in layouts.values()})}


def assert_close(got, want, what):
    assert len(got) == len(want), f"{what}: {len(got)} losses, expected {len(want)}"
    rel = [abs(a - b) / abs(b) for a, b in zip(got, want)]
    assert max(rel) < LOSS_TOL, f"{what}: max relative difference {max(rel):.3g}\n{got}\n{want}"


def check_losses(name, layout: Layout, results, reference):
    """The last stage reports the reference losses; the other stages none. `reference`: the
    single-process run (`reference_run`) or its losses; with the run, the last stage's
    gradient norms must equal its too (Adam's step hardly depends on the gradients' scale,
    so the losses alone would not show a gradient reduced with the wrong divisor)."""
    run = reference if isinstance(reference, dict) else {"losses": reference}
    assert len(run["losses"]) == ITERS
    for rank, result in enumerate(results):
        got = result[name]
        if layout.is_last_stage(rank):
            assert got["iterations"] == list(range(1, ITERS + 1)), f"rank {rank}"
            assert_close(got["losses"], run["losses"], f"{name} rank {rank}")
            if run.get("grad norms"):
                assert_close(got["grad norms"], run["grad norms"], f"{name} rank {rank} grad norms")
        else:
            assert got["losses"] == [], f"rank {rank} is not on the last stage but reported losses"


def check_resume(name, layout: Layout, results, workdir):
    """Saved at SAVE_AT in the layout's folders; resuming gives the same losses bit for bit."""
    save = checkpoint_dir(workdir, name)
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == str(SAVE_AT)
    folders = sorted(os.listdir(os.path.join(save, f"iter_{SAVE_AT:07d}")))
    if layout.pp == 1:
        assert folders == [f"mp_rank_{t:02d}" for t in range(layout.tp)], folders
    else:
        assert folders == [f"mp_rank_{t:02d}_{p:03d}" for t in range(layout.tp)
                           for p in range(layout.pp)], folders
    for rank, result in enumerate(results):
        if not layout.is_last_stage(rank):
            continue
        full, first, resumed = result[name], result[name + "/first"], result[name + "/resumed"]
        assert first["iterations"] == list(range(1, SAVE_AT + 1)), f"rank {rank}"
        assert first["losses"] == full["losses"][:SAVE_AT], f"rank {rank}"
        assert resumed["iterations"] == list(range(SAVE_AT + 1, ITERS + 1)), f"rank {rank}"
        assert resumed["losses"] == full["losses"][SAVE_AT:], f"rank {rank}: resumed run differs"


def model_fixtures(name: str, layouts: Dict[str, Layout], model: List[str], rank_fn):
    """The module fixtures (workdir, reference, spawns) of a layout test of one model: the
    data in a fresh directory `name`, the single-process run of `model`'s flags, and every
    layout's run (`rank_fn(rank, world, data_prefix, workdir)`, a module-level function
    calling `train_layouts`), one spawn per world size."""
    import pytest
    from tests.gpt_setup import wiki_workdir

    @pytest.fixture(scope="module")
    def reference(workdir):
        prefix, out = workdir
        return reference_run(prefix, out / "cache-ref", *model)

    @pytest.fixture(scope="module")
    def spawns(workdir):
        return spawn_worlds(rank_fn, layouts, *workdir)
    return wiki_workdir(name), reference, spawns
