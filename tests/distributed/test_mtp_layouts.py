"""A tiny GPT with one MTP layer trains like one process at every layout and resumes
(issue 30, item 2).

The model: tests/distributed/layouts.py's LLaMA-style one (RoPE, RMSNorm, SwiGLU, GQA,
untied head, 2 layers) with --mtp-num-layers 1; a tied-head variant at PP 2; and an MoE
variant (4 experts, top-2, load-balancing loss; the MTP layer is an MoE layer too, as the
last decoder layer is) for EP 2. In one spawn of 2 ranks: TP 2 with sequence parallelism,
EP 2, PP 2 with --pipeline-model-parallel-layout "Et|tmL" (the MTP layer and its embedding
copy on the last stage), PP 2 x VP 2 from "E|t|t|mL" (interleaved), CP 2 with p2p and a2a
(the shift crosses the ranks' chunks) and the distributed optimizer at DP 2. Over 10
iterations the lm loss, the mtp_1 loss and the gradient norm of each equal the
single-process run's within 1e-5; PP 2 (torch and torch_dist), CP 2 and DP 2 saved at
iteration 5 resume to the same losses bit for bit. tools/merge_mp_partitions.py re-shards
the TP 2 checkpoint to TP 1 x PP 2 with the MTP layer and an embedding copy on the last
stage, the same tensors as its TP 1 merge, and both train on alike.
"""
import pytest

from tests.distributed.layouts import (ITERS, SAVE_AT, Layout, assert_close, check_losses,
                                       check_resume, checkpoint_dir, llama_style, reference_run,
                                       spawn_worlds, train_layouts)
from tests.distributed.run_ranks import run_ranks
from tests.gpt_setup import wiki_workdir

MTP = llama_style(32) + ["--mtp-num-layers", "1"]
TIED = [flag for flag in MTP if flag != "--untie-embeddings-and-output-weights"]
MOE = MTP + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
             "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall"]
LAYOUT = ["--pipeline-model-parallel-layout", "Et|tmL"]
LAYOUTS = {
    "tp2-sp": Layout(2, 1, 1, mbs=2, keep=True, extra=MTP + ["--sequence-parallel"]),
    "ep2": Layout(1, 1, 2, mbs=2, extra=MOE + ["--expert-model-parallel-size", "2"]),
    "pp2-layout": Layout(1, 2, 1, mbs=2, resume=True, extra=MTP + LAYOUT),
    "pp2-layout-torch-dist": Layout(1, 2, 1, mbs=2, resume=True,
                                    extra=MTP + LAYOUT + ["--ckpt-format", "torch_dist"]),
    "pp2-layout-tied": Layout(1, 2, 1, mbs=2, extra=TIED + LAYOUT),
    "pp2-vp2-layout": Layout(1, 2, 1, mbs=2, extra=MTP + [
        "--pipeline-model-parallel-layout", "E|t|t|mL"]),  # interleaved; MTP in its own chunk
    "cp2": Layout(1, 1, 1, mbs=2, cp=2, resume=True, extra=MTP),
    "cp2-a2a": Layout(1, 1, 1, mbs=2, cp=2, extra=MTP + ["--cp-comm-type", "a2a"]),
    "dp2-distributed-optimizer": Layout(1, 1, 2, mbs=2, resume=True,
                                        extra=MTP + ["--use-distributed-optimizer"]),
}
REFERENCE = {"ep2": MOE, "pp2-layout-tied": TIED}


def _rank(rank, world_size, data_prefix, workdir):
    return train_layouts(LAYOUTS, world_size, data_prefix, workdir)


workdir = wiki_workdir("mtp-layouts")


@pytest.fixture(scope="module")
def references(workdir):
    prefix, out = workdir
    flags = {"mtp": MTP, **REFERENCE}
    return {name: reference_run(prefix, out / "cache-ref", *extra) for name, extra in flags.items()}


@pytest.fixture(scope="module")
def spawn(workdir):
    return spawn_worlds(_rank, LAYOUTS, *workdir, timeout=2400)[2]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mtp_layout_equals_one_process(name, references, spawn):
    layout, run = LAYOUTS[name], references.get(name, references["mtp"])
    check_losses(name, layout, spawn, run)  # lm loss and grad norm
    want = [h["mtp_1 loss"] for h in run["mtp"]]
    assert len(want) == ITERS and min(want) > 1.0, want
    for rank, result in enumerate(spawn):
        if layout.is_last_stage(rank):
            assert_close([h["mtp_1 loss"] for h in result[name]["mtp"]], want,
                         f"{name} rank {rank} mtp_1 loss")


@pytest.mark.parametrize("name", [n for n, layout in LAYOUTS.items() if layout.resume])
def test_mtp_layout_resumes_exactly(name, workdir, spawn):
    if "torch_dist" not in LAYOUTS[name].extra:  # (its folders are Megatron-Core's)
        check_resume(name, LAYOUTS[name], spawn, workdir[1])
    for rank, result in enumerate(spawn):
        if LAYOUTS[name].is_last_stage(rank):
            for field in ("losses", "mtp"):
                full, resumed = result[name][field], result[name + "/resumed"][field]
                assert len(resumed) == ITERS - SAVE_AT, f"rank {rank}"
                assert resumed == full[SAVE_AT:], f"rank {rank} {field}"


def _stage_tensors(root):
    import glob
    from megatron.checkpointing.io import load_file
    from megatron.checkpointing.model_file import from_megatron_layout
    files = sorted(glob.glob(f"{root}/iter_*/mp_rank_*/model_optim_rng.pt"))
    return [from_megatron_layout(load_file(f)["model"]) for f in files]


def test_merge_mp_partitions_puts_mtp_on_the_last_stage(workdir, spawn, tmp_path):
    import torch
    from tools import merge_mp_partitions
    source = checkpoint_dir(workdir[1], "tp2-sp", final=True)
    for pp in (1, 2):
        assert merge_mp_partitions.main(["--load", source, "--save", str(tmp_path / f"pp{pp}"),
                                         "--target-pipeline-model-parallel-size", str(pp)]) == 0
    (whole,), (first, last) = _stage_tensors(tmp_path / "pp1"), _stage_tensors(tmp_path / "pp2")
    assert any(n.startswith("mtp.layers.0.") for n in whole)
    assert not any(n.startswith("mtp.") for n in first)
    word = "language_model.embedding.word_embeddings.weight"
    assert torch.equal(first[word], whole[word]) and torch.equal(last[word], whole[word])
    renamed = {n.replace("layers.0.", "layers.1.") if n.startswith("language_model.encoder.layers")
               else n: t for n, t in last.items()}
    assert set(first) | set(renamed) == set(whole)
    for name, tensor in {**first, **renamed}.items():
        assert torch.equal(tensor, whole[name]), name


def _finetune(rank, world_size, argv):
    from tests.distributed.layouts import train
    return train(argv)


def test_merged_checkpoints_load_at_pp_1_and_pp_2_alike(workdir, spawn, tmp_path):
    """The TP 1 and TP 1 x PP 2 merges train on from the same weights: the first iteration's
    lm loss and mtp_1 loss of PP 2 "Et|tmL" equal one process's."""
    from tools import merge_mp_partitions
    prefix, out = workdir
    source = checkpoint_dir(out, "tp2-sp", final=True)
    runs = {}
    for pp in (1, 2):
        merged = str(tmp_path / f"pp{pp}")
        assert merge_mp_partitions.main(["--load", source, "--save", merged,
                                         "--target-pipeline-model-parallel-size", str(pp)]) == 0
        layout = Layout(1, pp, 1, mbs=2, extra=MTP + (LAYOUT if pp == 2 else []) + [
            "--load", merged, "--finetune", "--train-iters", "2"])
        argv = layout.argv(prefix, str(out / "cache-ref"))
        runs[pp] = (reference_run(prefix, out / "cache-ref", *layout.extra) if pp == 1 else
                    run_ranks(_finetune, 2, argv)[1])
    assert len(runs[1]["losses"]) == 2
    assert_close(runs[2]["losses"], runs[1]["losses"], "lm loss from the PP 2 merge")
    assert_close([h["mtp_1 loss"] for h in runs[2]["mtp"]],
                 [h["mtp_1 loss"] for h in runs[1]["mtp"]], "mtp_1 loss from the PP 2 merge")
