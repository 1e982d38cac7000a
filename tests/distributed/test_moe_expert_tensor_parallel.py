"""--expert-tensor-parallel-size below TP: the MoE model trains like one process and its
checkpoints re-shard.

The model of test_moe_layouts.py (8 experts, top-2, aux and z-loss, a shared expert,
every other layer MoE, RoPE / RMSNorm / SwiGLU / GQA). With ETP 1 each expert is whole on
one rank and the experts spread over ETP x EP; the TP ranks split the tokens they share.
At TP 2 x ETP 1 (EP 1, with and without sequence parallelism), TP 2 x ETP 1 x EP 2 (both
dispatchers, sequence parallelism, the distributed optimizer, torch_dist with its dense and MoE
layers keyed per layer), TP 2 x ETP 1 x PP 2,
TP 2 x CP 2 x ETP 1 x EP 2, TP 2 x ETP 1 x EP 4 (the EP groups span TP and DP) and
TP 4 x ETP 2 x EP 2 (grouped GEMM), 10 iterations
reproduce the single-process losses and gradient norms within 1e-5; the runs saved at
iteration 5 resume bit for bit from the (TP, EP) cells their ranks hold.

The TP 2 x ETP 1 x EP 2 checkpoint (cells mp_rank_00_000 and mp_rank_01_001 only) merges
with tools/merge_mp_partitions.py to one process and to ETP = TP (TP 2 x EP 2), and back
to ETP 1 tensor for tensor; the logits of one sequence agree within 1e-5 from the
ETP 1 files, the merged single-process file, the ETP 2 files and --universal-checkpoint
loading the ETP 1 checkpoint at ETP 2, and its parameter norm (--log-params-norm) is the
single-process one. Two spawns (2 and 4 ranks).
"""
import os

import numpy as np
import pytest
import torch

from tests.distributed.layouts import (LOSS_TOL, SAVE_AT, Layout, check_losses,
                                       checkpoint_dir, reference_run, spawn_worlds, train_layouts)
from tests.distributed.test_moe_layouts import MOE
from tests.distributed.test_moe_reshard import load_model, logits
from tests.gpt_setup import wiki_workdir



def _etp(etp, ep=1, dispatcher="allgather", *more, model=MOE):
    return model + ["--expert-tensor-parallel-size", str(etp), "--expert-model-parallel-size",
                  str(ep), "--moe-token-dispatcher-type", dispatcher, *more]


SP = "--sequence-parallel"
LAYOUTS = {
    "tp2-etp1": Layout(2, 1, 1, mbs=2, keep=True, extra=_etp(1)),
    "tp2-etp1-sp-alltoall": Layout(2, 1, 1, mbs=2, extra=_etp(1, 1, "alltoall", SP)),
    "tp2-etp1-ep2": Layout(2, 1, 2, mbs=2, resume=True, extra=_etp(1, 2)),
    "tp2-etp1-ep2-alltoall-sp": Layout(2, 1, 2, mbs=2, extra=_etp(1, 2, "alltoall", SP)),
    "tp2-etp1-ep2-distributed-optimizer": Layout(2, 1, 2, mbs=2, resume=True, extra=_etp(
        1, 2, "alltoall", "--use-distributed-optimizer")),
    "tp2-etp1-ep2-torch-dist": Layout(2, 1, 2, mbs=2, resume=True, extra=_etp(
        1, 2, "allgather", "--ckpt-format", "torch_dist")),
    "tp2-etp1-pp2": Layout(2, 2, 1, mbs=2, resume=True, extra=_etp(1)),
    "tp2-cp2-etp1-ep2-alltoall": Layout(2, 1, 1, mbs=2, cp=2, extra=_etp(1, 2, "alltoall")),
    "tp2-etp1-ep4-alltoall": Layout(2, 1, 2, mbs=2, extra=_etp(1, 4, "alltoall")),
    "tp4-etp2-ep2-grouped-gemm": Layout(4, 1, 1, mbs=2, extra=_etp(2, 2, "alltoall",
                                                                    "--moe-grouped-gemm")),
}
ONLY = os.environ.get("MOE_TEST_ONLY")
if ONLY:
    LAYOUTS = {k: v for k, v in LAYOUTS.items() if k in ONLY.split(",")}
SOURCE = "tp2-etp1-ep2"
"""The checkpoint the re-shard checks start from (saved at iteration SAVE_AT)."""


def _merge(load, save, *target):
    from tools import merge_mp_partitions
    assert merge_mp_partitions.main(["--load", load, "--save", save, *target]) == 0


def _reshard_logits(out):
    """Merge the SOURCE checkpoint (rank 0), then the logits at TP 2 x EP 2 from its own
    ETP 1 files, from the merged ETP 2 files and from --universal-checkpoint (ETP 1 -> 2)."""
    import torch.distributed as dist
    from megatron.mpu import initialize_model_parallel
    from megatron.training.model_stats import num_zeros_in_grad, params_norm
    source = checkpoint_dir(out, SOURCE)
    if dist.get_rank() == 0:
        _merge(source, os.path.join(out, "one"))
        _merge(source, os.path.join(out, "etp2"), "--target-tensor-model-parallel-size", "2",
               "--target-expert-model-parallel-size", "2")
        _merge(os.path.join(out, "etp2"), os.path.join(out, "etp2-to-etp1"),
               "--target-tensor-model-parallel-size", "2",
               "--target-expert-model-parallel-size", "2",
               "--target-expert-tensor-parallel-size", "1")
    dist.barrier()
    etp1 = initialize_model_parallel(2, ep=2, etp=1)
    got = {"etp1 files": logits(source, etp1)}
    model = load_model(source, etp1)
    stats = {"params norm": params_norm([model], etp1),
             "num zeros": num_zeros_in_grad([_small_values_as_zero_grads(model)], etp1)}
    etp2 = initialize_model_parallel(2, ep=2)
    got["etp2 files"] = logits(os.path.join(out, "etp2"), etp2)
    stats["num zeros etp2"] = num_zeros_in_grad(
        [_small_values_as_zero_grads(load_model(os.path.join(out, "etp2"), etp2))], etp2)
    got["universal etp1 -> etp2"] = logits(source, etp2, universal=True)
    got["universal etp2 -> etp1"] = logits(os.path.join(out, "etp2"), etp1, universal=True)
    return got, stats


def _small_values_as_zero_grads(model):
    """Gives every parameter a gradient that is 0 where its value is small (and not exactly 0,
    as the vocabulary padding, which differs between TP sizes), 1 elsewhere: the same entries
    on every layout of one checkpoint."""
    for p in model.parameters():
        small = (p.detach().abs() < 0.02) & (p.detach() != 0)
        p.grad = torch.where(small, 0.0, 1.0).to(p.dtype)
    return model


ODD = 31
"""Tokens of the inference check: not divisible by TP / ETP = 2, so the token parts are
padded with rows that route nowhere."""


def _rank(rank, world_size, data_prefix, workdir):
    results = train_layouts(LAYOUTS, world_size, data_prefix, workdir)
    if world_size == 4 and SOURCE in LAYOUTS:
        results["logits"], results["stats"] = _reshard_logits(workdir)
    if world_size == 2 and "tp2-etp1" in LAYOUTS:
        from megatron.mpu import initialize_model_parallel
        results["odd logits"] = logits(checkpoint_dir(workdir, "tp2-etp1", final=True),
                                       initialize_model_parallel(2, etp=1), length=ODD)
    return results


workdir = wiki_workdir("moe-etp")


@pytest.fixture(scope="module")
def references(workdir):
    prefix, out = workdir
    return {"moe": reference_run(prefix, out / "cache-ref", *MOE)}


@pytest.fixture(scope="module")
def spawns(workdir):
    return spawn_worlds(_rank, LAYOUTS, *workdir)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_etp_layout_losses_and_grad_norms_equal_one_process(name, references, spawns):
    layout, reference = LAYOUTS[name], references["moe"]
    results = spawns[layout.world]
    check_losses(name, layout, results, reference)  # the grad norms too
    got = results[-1][name]
    worst = [max(abs(a - b) / abs(b) for a, b in zip(got[key], reference[key]))
             for key in ("losses", "grad norms")]
    print(f"{name}: max relative difference of losses {worst[0]:.2e}, grad norms {worst[1]:.2e}")


@pytest.mark.parametrize("name", [n for n, layout in LAYOUTS.items() if layout.resume])
def test_etp_checkpoint_holds_the_cells_and_resumes_exactly(name, workdir, spawns):
    layout = LAYOUTS[name]
    folders = sorted(os.listdir(os.path.join(checkpoint_dir(workdir[1], name),
                                             f"iter_{SAVE_AT:07d}")))
    folders = [f for f in folders if not f.startswith(".")]
    if "torch_dist" in layout.extra:
        assert ".metadata" in os.listdir(os.path.join(checkpoint_dir(workdir[1], name),
                                                      f"iter_{SAVE_AT:07d}"))
    elif "--expert-model-parallel-size" in layout.extra and "2" == layout.extra[
            layout.extra.index("--expert-model-parallel-size") + 1]:
        # ETP 1: TP rank t holds EP rank t (mod 2); the other cells exist on no rank.
        # The distributed optimizer's shards sit in mp_rank_TT.
        want = ["mp_rank_00_000", "mp_rank_01_001"]
        assert [f for f in folders if f.count("_") == 3] == want, folders
    else:
        stage = "" if layout.pp == 1 else "_{p:03d}"
        assert folders == sorted(f"mp_rank_{t:02d}{stage.format(p=p)}" for t in range(layout.tp)
                                 for p in range(layout.pp)), folders
    for rank, result in enumerate(spawns[layout.world]):
        if not layout.is_last_stage(rank):
            continue
        full, first, resumed = result[name], result[name + "/first"], result[name + "/resumed"]
        assert first["losses"] == full["losses"][:SAVE_AT], f"rank {rank}"
        assert resumed["iterations"] == list(range(SAVE_AT + 1, 11)), f"rank {rank}"
        assert resumed["losses"] == full["losses"][SAVE_AT:], f"rank {rank}: resumed run differs"


def _close(got, want, what):
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < LOSS_TOL, f"{what}: logits differ by {rel:.3g} (relative to the largest)"


def _halves(want, rank):
    half = want.shape[-1] // 2
    return want[..., rank % 2 * half:(rank % 2 + 1) * half]


def test_etp_inference_with_padded_token_parts_equals_one_process(workdir, spawns):
    """31 tokens at TP 2 x ETP 1 (one pad row) give the logits of one process (the same
    checkpoint re-sharded to TP 1 in memory)."""
    from megatron.mpu.parallel_state import single_process_state
    if "tp2-etp1" not in LAYOUTS:
        pytest.skip("MOE_TEST_ONLY left out tp2-etp1")
    want = logits(checkpoint_dir(workdir[1], "tp2-etp1", final=True), single_process_state(),
                  universal=True, length=ODD)
    for rank, result in enumerate(spawns[2]):
        _close(result["odd logits"], _halves(want, rank), f"rank {rank}")


def test_etp_checkpoint_reshards_with_equal_logits(workdir, spawns):
    from megatron.checkpointing.model_file import from_megatron_layout, read_model_file
    from megatron.mpu.parallel_state import single_process_state
    if SOURCE not in LAYOUTS:
        pytest.skip("MOE_TEST_ONLY left out the source checkpoint")
    from megatron.training.model_stats import num_zeros_in_grad, params_norm
    out = workdir[1]
    one = single_process_state()
    want = logits(os.path.join(out, "one"), one)
    model = load_model(os.path.join(out, "one"), one)
    want_norm = params_norm([model], one)
    want_zeros = num_zeros_in_grad([_small_values_as_zero_grads(model)], one)
    for rank, result in enumerate(spawns[4]):
        for what, got in result["logits"].items():  # TP 2: this rank's half of the vocabulary
            _close(got, _halves(want, rank), f"{what} rank {rank}")
        # --log-params-norm and --log-num-zeros-in-grad count each expert shard once (ETP x
        # EP), the dense ones per TP
        stats = result["stats"]
        assert abs(stats["params norm"] - want_norm) <= LOSS_TOL * want_norm, (
            rank, stats["params norm"], want_norm)
        assert stats["num zeros"] == stats["num zeros etp2"] == want_zeros > 0, (
            rank, stats, want_zeros)
    def model(root, cell):
        path = os.path.join(root, f"iter_{SAVE_AT:07d}", cell, "model_optim_rng.pt")
        return from_megatron_layout(read_model_file(path)["model"])

    for cell in ("mp_rank_00_000", "mp_rank_01_001"):
        source = model(checkpoint_dir(out, SOURCE), cell)
        back = model(os.path.join(out, "etp2-to-etp1"), cell)
        assert source.keys() == back.keys()
        assert all(torch.equal(source[k], back[k]) for k in source), cell
    experts = "language_model.encoder.layers.0.mlp.experts.linear_fc1.weight"
    assert source[experts].shape == (4, 128, 64)  # 4 whole experts ([gate; up] x 64, h 64)
