"""The whole tiny DeepSeek-V3-style model trains like one process at every layout (issue 30).

The model: MLA with query and KV compression (--q-lora-rank 16, --kv-lora-rank 16, qk head
24 + 8 RoPE channels, value head 8), a first dense layer ("[0,1]": layer 0 dense, layer 1
MoE), 8 routed experts plus 1 shared, grouped sigmoid top-2 (4 groups, top-2 groups) with
an expert bias and routed scaling, and 1 MTP layer (an MoE layer, as the last decoder
layer is); RMSNorm, SwiGLU, untied head, no biases; hidden 32, 2 layers, seq 32. With the
machinery of tests/distributed/layouts.py, 10 iterations at TP 2 with SP, EP 2, TP 2 x EP 2,
PP 2 with --pipeline-model-parallel-layout "Et|tmL", PP 2 x VP 2 from "E|t|t|mL", CP 2 (p2p
and a2a) and the distributed optimizer at DP 2 reproduce the single-process lm loss, mtp_1
loss and gradient norm within 1e-5; PP 2 "Et|tmL" and EP 2 saved at iteration 5 resume to
the uninterrupted run bit for bit, and their final expert biases (of the MoE decoder layer and
of the MTP layer's MoE) equal one process's. Two spawns (2 and 4 ranks).
"""
import pytest

from tests.distributed import layouts as L

MLA = ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "16",
       "--qk-head-dim", "24", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "8"]
MOE = ["--num-experts", "8", "--moe-ffn-hidden-size", "16", "--moe-layer-freq", "[0,1]",
       "--moe-shared-expert-intermediate-size", "16", "--moe-router-topk", "2",
       "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
       "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
       "--moe-router-topk-scaling-factor", "2.5", "--moe-aux-loss-coeff", "1e-3",
       "--moe-router-load-balancing-type", "seq_aux_loss",
       "--moe-token-dispatcher-type", "alltoall"]
MODEL = ["--use-rotary-position-embeddings", "--normalization", "RMSNorm", "--swiglu",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--ffn-hidden-size", "64", *MLA, *MOE, "--mtp-num-layers", "1"]
EP2 = ["--expert-model-parallel-size", "2"]

LAYOUTS = {
    "tp2-sp": L.Layout(2, 1, 1, mbs=2, extra=MODEL + ["--sequence-parallel"]),
    "ep2": L.Layout(1, 1, 2, mbs=2, resume=True, keep=True, extra=MODEL + EP2),
    "tp2-ep2": L.Layout(2, 1, 2, mbs=2, extra=MODEL + EP2 + ["--sequence-parallel"]),
    "pp2-layout": L.Layout(1, 2, 1, mbs=2, resume=True, keep=True, extra=MODEL + [
        "--pipeline-model-parallel-layout", "Et|tmL"]),
    "pp2-vp2-layout": L.Layout(1, 2, 1, mbs=2, extra=MODEL + [
        "--pipeline-model-parallel-layout", "E|t|t|mL"]),
    "cp2": L.Layout(1, 1, 1, mbs=2, cp=2, extra=MODEL),
    "cp2-a2a": L.Layout(1, 1, 1, mbs=2, cp=2, extra=MODEL + ["--cp-comm-type", "a2a"]),
    "dp2-distributed-optimizer": L.Layout(1, 1, 2, mbs=2, extra=MODEL + [
        "--use-distributed-optimizer"]),
}


def _rank(rank, world_size, data_prefix, workdir):
    return L.train_layouts(LAYOUTS, world_size, data_prefix, workdir)


workdir, _, spawns = L.model_fixtures("deepseek-v3-layouts", LAYOUTS, MODEL, _rank)


@pytest.fixture(scope="module")
def reference(workdir):
    """The single-process run, its model saved at the last iteration."""
    prefix, out = workdir
    return L.reference_run(prefix, out / "cache-ref", *MODEL, "--save",
                           L.checkpoint_dir(out, "reference", final=True), "--save-interval",
                           str(L.ITERS))


def _expert_biases(root) -> dict:
    """{file: {name: tensor}} of the routers' expert biases in each model file of `root`."""
    import glob
    from megatron.checkpointing.io import load_file
    from megatron.checkpointing.model_file import from_megatron_layout
    files = sorted(glob.glob(f"{root}/iter_*/mp_rank_*/model_optim_rng.pt"))
    return {f: {n: t for n, t in from_megatron_layout(load_file(f)["model"]).items()
                if n.endswith("router.expert_bias")} for f in files}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_deepseek_v3_layout_equals_one_process(name, reference, spawns):
    layout = LAYOUTS[name]
    L.check_losses(name, layout, spawns[layout.world], reference)  # lm loss and grad norm
    want = [h["mtp_1 loss"] for h in reference["mtp"]]
    assert len(want) == L.ITERS and min(want) > 1.0, want
    for rank, result in enumerate(spawns[layout.world]):
        if layout.is_last_stage(rank):
            L.assert_close([h["mtp_1 loss"] for h in result[name]["mtp"]], want,
                           f"{name} rank {rank} mtp_1 loss")


@pytest.mark.parametrize("name", [n for n, layout in LAYOUTS.items() if layout.resume])
def test_deepseek_v3_checkpoint_resumes_exactly(name, workdir, spawns):
    layout = LAYOUTS[name]
    if layout.pp > 1:  # (EP runs save Megatron-LM's per-EP-rank folders)
        L.check_resume(name, layout, spawns[layout.world], workdir[1])
    for rank, result in enumerate(spawns[layout.world]):
        if layout.is_last_stage(rank):
            for what in ("losses", "mtp", "grad norms"):
                full, resumed = result[name][what], result[name + "/resumed"][what]
                assert len(resumed) == L.ITERS - L.SAVE_AT, f"rank {rank}"
                assert resumed == full[L.SAVE_AT:], f"rank {rank} {what}: resumed run differs"


@pytest.mark.parametrize("name", [n for n, layout in LAYOUTS.items() if layout.keep])
def test_deepseek_v3_expert_biases_move_as_in_one_process(name, workdir, reference, spawns):
    """The aux-loss-free balancing of the MoE decoder layer and of the MTP layer's MoE moves
    their expert biases as one process does (the loads summed over EP / the stages)."""
    import torch
    (want,) = _expert_biases(L.checkpoint_dir(workdir[1], "reference", final=True)).values()
    decoder = want["language_model.encoder.layers.1.mlp.router.expert_bias"]
    mtp = want["mtp.layers.0.transformer_layer.mlp.router.expert_bias"]
    assert decoder.abs().max() > 0 and mtp.abs().max() > 0, "the biases never moved"
    seen = set()
    for path, biases in _expert_biases(L.checkpoint_dir(workdir[1], name, final=True)).items():
        for key, bias in biases.items():
            kind = "mtp" if key.startswith("mtp.") else "decoder"
            seen.add(kind)
            assert torch.equal(bias, mtp if kind == "mtp" else decoder), (path, key)
    assert seen == {"mtp", "decoder"}, seen
