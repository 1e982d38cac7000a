"""gpt-oss's MoE trains like one process at EP 2 and at TP 2 with expert TP: a 2-layer model
with the router bias, per-expert biases on both linears, the clamped quick-GeGLU
(--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value 7) and learnable sinks;
10 iterations at EP 2 (allgather, alltoall, grouped GEMM), TP 2 x ETP 2 (expert biases
split with their rows; sequence parallel) and TP 2 x ETP 1 x EP 2 reproduce the
single-process losses and gradient norms within 1e-5. One spawn of 2 ranks."""
import pytest

from tests.distributed import layouts as L

MODEL = ["--use-rotary-position-embeddings", "--normalization", "RMSNorm", "--quick-geglu",
         "--glu-linear-offset", "1", "--activation-func-clamp-value", "7",
         "--softmax-type", "learnable", "--group-query-attention", "--num-query-groups", "2",
         "--untie-embeddings-and-output-weights", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
         "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
         "--moe-aux-loss-coeff", "1e-2"]


def _moe(*more):
    return MODEL + list(more)


LAYOUTS = {
    "ep2-allgather": L.Layout(1, 1, 2, mbs=2, extra=_moe("--expert-model-parallel-size", "2")),
    "ep2-alltoall": L.Layout(1, 1, 2, mbs=2, extra=_moe(
        "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall")),
    "ep2-grouped-gemm": L.Layout(1, 1, 2, mbs=2, extra=_moe(
        "--expert-model-parallel-size", "2", "--moe-grouped-gemm")),
    "tp2-etp2-sequence-parallel": L.Layout(2, 1, 1, mbs=2, extra=_moe("--sequence-parallel")),
    "tp2-etp1-ep2": L.Layout(2, 1, 1, mbs=2, extra=_moe(
        "--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2")),
}


def _rank(rank, world_size, data_prefix, workdir):
    return L.train_layouts(LAYOUTS, world_size, data_prefix, workdir)


workdir, reference, spawns = L.model_fixtures("gpt-oss-moe-layouts", LAYOUTS, MODEL, _rank)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gpt_oss_moe_layout_losses_equal_one_process(name, reference, spawns):
    layout = LAYOUTS[name]
    L.check_losses(name, layout, spawns[layout.world], reference)
