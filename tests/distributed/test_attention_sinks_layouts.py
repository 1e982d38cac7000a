"""Learnable attention sinks (--softmax-type learnable) train like one process at every
layout: the LLaMA-style model of the CP tests (seq 128) for 10 iterations at TP 2 with
sequence parallelism, PP 2, CP 2 (ring: the sink joins the merged softmax once), CP 2 with
a2a and DP 2 with the distributed optimizer reproduces the single-process losses and
gradient norms within 1e-5; TP 2's checkpoint (the sinks split with their heads) resumes
bit for bit and merges to TP 1 (tools/merge_mp_partitions.py) with each layer's sinks
whole. One spawn of 2 ranks."""
import os

import pytest
import torch

from tests.distributed import layouts as L

MODEL = L.llama_style(128) + ["--softmax-type", "learnable"]


LAYOUTS = {
    "tp2-sequence-parallel": L.Layout(2, 1, 1, mbs=2, extra=MODEL + ["--sequence-parallel"],
                                        resume=True),
    "pp2": L.Layout(1, 2, 1, mbs=2, extra=MODEL),
    "cp2-p2p": L.Layout(1, 1, 1, mbs=2, cp=2, extra=MODEL),
    "cp2-a2a": L.Layout(1, 1, 1, mbs=2, cp=2, extra=MODEL + ["--cp-comm-type", "a2a"]),
    "dp2-distributed-optimizer": L.Layout(1, 1, 2, mbs=2,
                                            extra=MODEL + ["--use-distributed-optimizer"]),
}


def _rank(rank, world_size, data_prefix, workdir):
    return L.train_layouts(LAYOUTS, world_size, data_prefix, workdir)


workdir, reference, spawns = L.model_fixtures("sinks-layouts", LAYOUTS, MODEL, _rank)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sink_layout_losses_equal_one_process(name, reference, spawns):
    layout = LAYOUTS[name]
    L.check_losses(name, layout, spawns[layout.world], reference)


def _sinks(path):
    """{name: tensor} of the sink logits in one checkpoint file."""
    from megatron.checkpointing.megatron_legacy import safe_load
    found = {}

    def walk(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif str(key).endswith("softmax_offset"):
                found[prefix + key] = value
    walk(safe_load(path)["model"])
    return found


def test_tp2_checkpoint_resumes_and_reshards_to_tp1(workdir, spawns):
    """Resumed bit for bit at TP 2; merged to TP 1 by tools/merge_mp_partitions.py, each
    layer's sinks are rank 0's heads then rank 1's."""
    from tools import merge_mp_partitions as mmp
    prefix, out = workdir
    name, layout = "tp2-sequence-parallel", LAYOUTS["tp2-sequence-parallel"]
    L.check_resume(name, layout, spawns[layout.world], out)
    save, merged = L.checkpoint_dir(out, name), str(out / "tp2-merged-to-tp1")
    assert mmp.main(["--load", save, "--save", merged]) == 0
    shards = [_sinks(os.path.join(save, "iter_0000005", f"mp_rank_0{r}", "model_optim_rng.pt"))
              for r in range(2)]
    whole = _sinks(os.path.join(merged, "iter_0000005", "mp_rank_00", "model_optim_rng.pt"))
    assert len(whole) == 2 and all(t.shape == (4,) for t in whole.values()), whole
    for key, tensor in whole.items():
        assert shards[0][key].shape == (2,)
        assert torch.equal(tensor, torch.cat([shards[0][key], shards[1][key]]))
