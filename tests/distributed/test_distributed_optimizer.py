"""--use-distributed-optimizer (ZeRO-1) and --DDP-impl torch give one process's losses.

Single-process checks: bucket layout and shard ranges, conversion of optimizer
state between the regular and the sharded form, unsupported flag combinations.
One spawn of 2 gloo ranks: a toy model in several buckets stepped by the
distributed optimizer against MegatronOptimizer on the whole batch; the tiny GPT
of tests/gpt_setup at DP=2 with the distributed optimizer (fp32, bf16, fp16 with
overflows, a save at 5 and an exact resume to 10, a regular checkpoint resumed
sharded) and with torch's DDP. The parent compares with a single-process run,
resumes the DP=2 checkpoint in one process without the distributed optimizer
(consolidating the shards) and checks the error for a changed DP size. A second
spawn of 4 ranks (TP=2 x DP=2) compares the sharded and the regular optimizer.
"""
import contextlib
import os

import pytest
import torch

from megatron.config import ConfigError, OptimizerConfig, ParallelConfig
from megatron.distributed.ddp import GradReducer, plan_buckets, shard_range
from megatron.mpu import single_process_state
from megatron.optimizer import DistributedOptimizer, MegatronOptimizer, merge_optimizer_shards
from megatron.checkpointing import megatron_legacy
from tests.distributed.run_ranks import run_ranks
from tests.gpt_setup import losses, one_thread, preprocess_wiki, tiny_gpt_argv


# -- single process ----------------------------------------------------------------------
def test_plan_buckets_pads_each_bucket_for_the_shards():
    offsets, buckets = plan_buckets([5, 7, 3, 20, 1], bucket_size=10, pad_to=8)
    assert offsets == [0, 5, 16, 19, 40]
    assert buckets == [(0, 16, 2), (16, 40, 2), (40, 48, 1)]
    assert plan_buckets([5, 7], bucket_size=100) == ([0, 5], [(0, 12, 2)])
    assert [shard_range(16, 40, 4, r) for r in range(4)] == [(16, 22), (22, 28), (28, 34), (34, 40)]


def test_unsupported_reducer_combinations_are_config_errors():
    with pytest.raises(ConfigError, match="torch supports --pipeline-model-parallel-size 1 only"):
        ParallelConfig(DDP_impl="torch", pipeline_model_parallel_size=2)
    with pytest.raises(ConfigError, match="needs --DDP-impl local"):
        ParallelConfig(DDP_impl="torch", use_distributed_optimizer=True)
    ParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                   pipeline_model_parallel_size=2)  # supported: see test_layouts.py


class _Toy(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(37, 23).to(dtype)   # 2-D weight + 1-D bias
        self.norm = torch.nn.LayerNorm(23).to(dtype)
        self.b = torch.nn.Linear(23, 150, bias=False).to(dtype)


def _fake_rank_optimizer(model, rank, dp_size, cfg):
    """The DistributedOptimizer DP rank `rank` of `dp_size` would build (no process group)."""
    reducer = GradReducer(list(model.parameters()), None, torch.float32, bucket_size=1500,
                          reduce_scatter=True)
    for bucket in reducer.buckets:  # padded to SHARD_ALIGNMENT, which dp_size divides
        bucket.shard = shard_range(bucket.start, bucket.start + bucket.data.numel(), dp_size, rank)
    return DistributedOptimizer(cfg, [model], single_process_state(), [reducer])


@pytest.mark.parametrize("dtype, optimizer", [(torch.float32, "adam"), (torch.bfloat16, "adam"),
                                              (torch.float32, "sgd")])
def test_regular_state_round_trips_through_shards(dtype, optimizer):
    """Regular state -> each rank's shard (cuts through parameters) -> merged == regular."""
    cfg = OptimizerConfig(lr=0.01, optimizer=optimizer, weight_decay=0.1)
    model = _Toy(dtype)
    regular = MegatronOptimizer(cfg, [model], single_process_state())
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        regular.step()
    expected = regular.state_dict()
    shards = []
    for rank in range(2):
        sharded = _fake_rank_optimizer(model, rank, 2, cfg)
        sharded.load_state_dict(expected)
        shards.append(sharded.state_dict())
    assert sum(len(s["pieces"]) for s in shards) > len(list(model.parameters()))  # a cut param
    merged = merge_optimizer_shards(shards)
    _assert_same_state(merged, expected)
    fresh = MegatronOptimizer(cfg, [_Toy(dtype)], single_process_state())
    fresh.load_state_dict(merged)  # the consolidated state loads into the regular optimizer


class _Stacked(torch.nn.Module):
    """Experts' stacked parameters, as ours hold them: a [3, 5] bias (one per expert)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.experts = torch.nn.Module()
        self.experts.weight = torch.nn.Parameter(torch.randn(3, 5, 4))
        self.experts.bias = torch.nn.Parameter(torch.randn(3, 5))
        self.norm = torch.nn.LayerNorm(4)


def test_biases_of_every_shape_and_norms_get_no_weight_decay():
    """Megatron-Core's rule in both optimizers (its per-expert biases are 1-D; our stacked
    ones must be exempt too), and the sharded state converts to the regular one with it."""
    cfg = OptimizerConfig(lr=0.01, weight_decay=0.1)
    model = _Stacked()
    exempt = {id(model.experts.bias), id(model.norm.weight), id(model.norm.bias)}
    regular = MegatronOptimizer(cfg, [model], single_process_state())
    assert regular.group_decays == [True, False]
    assert [g["weight_decay"] for g in regular.param_groups] == [0.1, 0.0]
    assert {id(p) for p in regular.param_groups[1]["params"]} == exempt
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    regular.step()
    shards, decays = [], {}
    for rank in range(2):
        sharded = _fake_rank_optimizer(model, rank, 2, cfg)
        decays.update((id(p.param), p.decays) for p in sharded.pieces)
        sharded.load_state_dict(regular.state_dict())
        shards.append(sharded.state_dict())
    assert {i for i, d in decays.items() if not d} == exempt
    assert {i for i, d in decays.items() if d} == {id(model.experts.weight)}
    _assert_same_state(merge_optimizer_shards(shards), regular.state_dict())


def _assert_same_state(got, expected):
    assert got.keys() == expected.keys()
    g_opt, e_opt = got["optimizer"], expected["optimizer"]
    for key in ("params", "weight_decay", "lr"):
        assert [g[key] for g in g_opt["param_groups"]] == [g[key] for g in e_opt["param_groups"]]
    assert g_opt["state"].keys() == e_opt["state"].keys()
    for key, state in e_opt["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(g_opt["state"][key][name]), torch.as_tensor(value))
    mains = got.get("fp32_from_fp16_params", []), expected.get("fp32_from_fp16_params", [])
    assert len(mains[0]) == len(mains[1])
    for g, e in zip(*mains):
        assert torch.equal(g, e)


# -- two ranks -----------------------------------------------------------------------------
@contextlib.contextmanager
def recording_grad_norms():
    """Collect the grad norm of every training step (Trainer.train_step's second result)."""
    from megatron.training.trainer import Trainer
    original, norms = Trainer.train_step, []

    def train_step(self, iterators):
        result = original(self, iterators)
        norms.append(result[1])
        return result

    Trainer.train_step = train_step
    try:
        yield norms
    finally:
        Trainer.train_step = original


def _run(argv):
    """(losses, grad norms) of one pretrain_gpt run in this process, on one thread."""
    import pretrain_gpt
    with one_thread(), recording_grad_norms() as norms:
        state = pretrain_gpt.main(argv)
    return losses(state), norms


def _toy_steps(rank, world_size, steps=3):
    """A toy model in 2 buckets (shards cut through parameters) trained at DP=2 by the
    distributed optimizer, and on the whole batch by MegatronOptimizer in this process."""
    import torch.distributed as dist
    from megatron.mpu.parallel_state import ParallelState
    from megatron.mpu.topology import ParallelDims
    cfg = OptimizerConfig(lr=0.01, weight_decay=0.1, clip_grad=0.5)
    pstate = ParallelState(dims=ParallelDims(world_size=world_size), rank=rank, dp_rank=rank,
                           dp_group=dist.group.WORLD, dp_ranks=list(range(world_size)))
    sharded_model, whole_model = _Toy(torch.float32), _Toy(torch.float32)
    reducer = GradReducer(list(sharded_model.parameters()), pstate.dp_group, torch.float32,
                          bucket_size=1500, reduce_scatter=True)
    sharded = DistributedOptimizer(cfg, [sharded_model], pstate, [reducer])
    whole = MegatronOptimizer(cfg, [whole_model], single_process_state())
    batch = torch.randn(2 * world_size, 37, generator=torch.Generator().manual_seed(5))
    norms = []
    for _ in range(steps):
        reducer.zero_grad()
        _toy_loss(sharded_model, batch.chunk(world_size)[rank]).backward()
        reducer.finish_grad_sync()
        _toy_loss(whole_model, batch).backward()
        norms.append((sharded.step()[1], whole.step()[1]))
    params = zip(sharded_model.parameters(), whole_model.parameters())
    return len(reducer.buckets), norms, [(a.detach(), b.detach()) for a, b in params]


def _toy_loss(model, x):
    return model.b(torch.nn.functional.gelu(model.norm(model.a(x)))).pow(2).mean()


def _worker(rank, world_size, tmp, prefix):
    def argv(*extra):
        return _argv(prefix, tmp, *extra)

    ckpt = os.path.join(tmp, "ckpt")
    out = {"toy": _toy_steps(rank, world_size)}
    out["dist"] = _run(argv("--use-distributed-optimizer"))
    out["first"] = _run(argv("--use-distributed-optimizer", "--save", ckpt,
                             "--save-interval", "100", "--exit-interval", "5"))
    out["resumed"] = _run(argv("--use-distributed-optimizer", "--load", ckpt))
    out["resumed_other_buckets"] = _run(argv("--use-distributed-optimizer", "--load", ckpt,
                                             "--ddp-bucket-size", "5000"))
    regular = os.path.join(tmp, "regular")  # a regular optimizer state, resumed sharded
    _run(argv("--save", regular, "--save-interval", "100", "--exit-interval", "5"))
    out["regular_to_dist"] = _run(argv("--use-distributed-optimizer", "--load", regular))
    out["torch_ddp"] = _run(argv("--DDP-impl", "torch"))
    out["bf16_dist"] = _run(argv("--bf16", "--use-distributed-optimizer"))
    out["bf16"] = _run(argv("--bf16"))
    fp16 = ["--fp16", "--initial-loss-scale", str(2 ** 20), "--hysteresis", "1"]  # overflows first
    out["fp16_dist"] = _run(argv(*fp16, "--use-distributed-optimizer"))
    out["fp16"] = _run(argv(*fp16))
    return out


def _argv(prefix, tmp, *extra):
    return tiny_gpt_argv(prefix, os.path.join(tmp, "cache"), "--eval-iters", "0", *extra,
                         layers=2)


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """The first articles of wiki.valid.jsonl preprocessed with the bpe-8k vocabulary."""
    return preprocess_wiki(tmp_path_factory.mktemp("corpus"), docs=4)


def _close(got, expected, rel):
    assert len(got) == len(expected) == 10
    assert got == pytest.approx(expected, rel=rel), (got, expected)


def test_dp2_distributed_optimizer_and_torch_ddp_match_one_process(tmp_path, small_corpus, capsys):
    tmp = str(tmp_path)
    single, single_norms = _run(_argv(small_corpus, tmp))
    ranks = run_ranks(_worker, 2, tmp, small_corpus, timeout=280)
    for buckets, norms, params in (r["toy"] for r in ranks):
        assert buckets == 2
        for sharded_norm, whole_norm in norms:
            assert sharded_norm == pytest.approx(whole_norm, rel=1e-5)
        for sharded, whole in params:
            torch.testing.assert_close(sharded, whole, rtol=1e-5, atol=1e-6)
    last = ranks[-1]
    dist_losses, dist_norms = last["dist"]
    _close(dist_losses, single, 1e-5)
    _close(dist_norms, single_norms, 1e-5)  # the sharded norm is the whole model's
    assert all(r["dist"][1] == dist_norms for r in ranks)  # every rank agrees on the norm
    first, resumed = last["first"][0], last["resumed"][0]
    assert first == dist_losses[:5] and resumed == dist_losses[5:]  # exact resume
    # other buckets cut the shards elsewhere: merged and re-cut on load
    assert last["resumed_other_buckets"][0] == pytest.approx(dist_losses[5:], rel=1e-5)
    assert last["regular_to_dist"][0] == pytest.approx(dist_losses[5:], rel=1e-5)
    _close(last["torch_ddp"][0], single, 1e-5)
    _close(last["bf16_dist"][0], last["bf16"][0], 1e-3)
    _check_fp16(last["fp16_dist"], last["fp16"])
    _check_checkpoint_files(os.path.join(tmp, "ckpt"))
    _resume_in_one_process(small_corpus, tmp, dist_losses, capsys)


def _check_fp16(dist, plain):
    """Skipped steps (grad norm None) agree: the overflow check is reduced over all ranks."""
    _close(dist[0], plain[0], 1e-3)
    skipped = [norm is None for norm in dist[1]]
    assert skipped == [norm is None for norm in plain[1]]
    assert any(skipped) and not all(skipped), dist[1]
    applied = [(d, p) for d, p in zip(dist[1], plain[1]) if d is not None]
    assert [d for d, _ in applied] == pytest.approx([p for _, p in applied], rel=1e-3)


def _check_checkpoint_files(ckpt):
    rank_dir = os.path.join(ckpt, "iter_0000005", "mp_rank_00")
    files = ["distrib_optim_dp_000.pt", "distrib_optim_dp_001.pt", "model_optim_rng.pt"]
    assert sorted(os.listdir(rank_dir)) == sorted(files + [f + ".sha256" for f in files])
    state = megatron_legacy.safe_load(os.path.join(rank_dir, "model_optim_rng.pt"))
    assert state["distributed_optimizer"] is True and "optimizer" not in state
    assert state["opt_param_scheduler"]["num_steps"] == 5 * 8
    shards = [megatron_legacy.safe_load(os.path.join(rank_dir, f"distrib_optim_dp_{r:03d}.pt"))
              for r in range(2)]
    numel = [sum(m.numel() for m in s["main_params"]) for s in shards]
    total = sum(torch.Size(shape).numel() for shape in shards[0]["param_shapes"])
    assert sum(numel) == total and abs(numel[0] - numel[1]) <= 2 * 128  # halves, up to padding


def _resume_in_one_process(prefix, tmp, dist_losses, capsys):
    """One process consolidates the DP=2 shards and continues like DP=2, with the
    regular optimizer and with the distributed one (a DP size change re-cuts the shards)."""
    ckpt = os.path.join(tmp, "ckpt")
    resumed, _ = _run(_argv(prefix, tmp, "--load", ckpt))
    assert resumed == pytest.approx(dist_losses[5:], rel=1e-5)
    resharded, _ = _run(_argv(prefix, tmp, "--use-distributed-optimizer", "--load", ckpt))
    assert resharded == pytest.approx(dist_losses[5:], rel=1e-5)


# -- four ranks: TP=2 x DP=2 ------------------------------------------------------------------
def _worker_tp2(rank, world_size, tmp, prefix):
    tp2 = ["--tensor-model-parallel-size", "2"]
    return {"plain": _run(_argv(prefix, tmp, *tp2)),
            "dist": _run(_argv(prefix, tmp, *tp2, "--use-distributed-optimizer"))}


def test_tp2_dp2_distributed_optimizer_matches_the_regular_one(tmp_path, small_corpus):
    """The sharded norm counts TP-replicated parameters once, as the regular one does."""
    ranks = run_ranks(_worker_tp2, 4, str(tmp_path), small_corpus, timeout=280)
    for result in ranks:
        (plain, plain_norms), (dist, dist_norms) = result["plain"], result["dist"]
        if plain:  # losses are reported on every rank of the last stage
            _close(dist, plain, 1e-5)
        _close(dist_norms, plain_norms, 1e-5)
        assert dist_norms == ranks[0]["dist"][1]
