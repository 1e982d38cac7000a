"""A tiny GPT with multi-latent attention trains like one process and resumes exactly.

The model: MLA with query and KV compression (--q-lora-rank 16, --kv-lora-rank 16), a
value head size (8) other than the query / key head size (24 + 8 RoPE channels: the CPU
kernel takes them, values zero-padded, where it is chosen), YaRN
with --mscale / --mscale-all-dim; RMSNorm, SwiGLU, untied head, no biases; hidden 32, 2
layers, seq 32. With the machinery of tests/distributed/layouts.py: 10 iterations at TP 2
with sequence parallelism and selective recomputation, TP 2 with full recomputation, CP 2
(p2p and a2a) and DP 2 with the distributed optimizer reproduce the single-process
losses and gradient norms within 1e-5; TP 2 + SP, CP 2 and DP 2 saved at iteration 5
resume bit for bit. One spawn of 2 ranks.
"""
import pytest

from tests.distributed import layouts as L

MODEL = ["--use-rotary-position-embeddings", "--normalization", "RMSNorm", "--swiglu",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "16",
         "--qk-head-dim", "24", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "8",
         "--rope-scaling-type", "yarn", "--rope-scaling-factor", "4",
         "--rope-scaling-original-max-position-embeddings", "8", "--mscale", "0.9",
         "--mscale-all-dim", "0.7"]

LAYOUTS = {
    "tp2-sequence-parallel-selective": L.Layout(
        2, 1, 1, mbs=2, resume=True,
        extra=MODEL + ["--sequence-parallel", "--recompute-granularity", "selective"]),
    "tp2-full-recompute": L.Layout(2, 1, 1, mbs=2, extra=MODEL + ["--recompute-granularity",
                                                                  "full"]),
    "cp2": L.Layout(1, 1, 1, mbs=2, cp=2, extra=MODEL, resume=True),
    "cp2-a2a": L.Layout(1, 1, 1, mbs=2, cp=2, extra=MODEL + ["--cp-comm-type", "a2a"]),
    "dp2-distributed-optimizer": L.Layout(1, 1, 2, mbs=2, resume=True,
                                          extra=MODEL + ["--use-distributed-optimizer"]),
}


def _rank(rank, world_size, data_prefix, workdir):
    return L.train_layouts(LAYOUTS, world_size, data_prefix, workdir)


workdir, reference, spawns = L.model_fixtures("mla-layouts", LAYOUTS, MODEL, _rank)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mla_layout_equals_one_process(name, reference, spawns):
    L.check_losses(name, LAYOUTS[name], spawns[2], reference)


@pytest.mark.parametrize("name", [n for n, layout in LAYOUTS.items() if layout.resume])
def test_mla_checkpoint_resumes_exactly(name, workdir, spawns):
    L.check_resume(name, LAYOUTS[name], spawns[2], workdir[1])
