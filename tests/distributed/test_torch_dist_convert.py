"""Conversions of torch_dist checkpoints (issue 20), in one process.

A tiny GPT trained at TP 2 (2 gloo ranks) is saved in both formats.
tools/merge_mp_partitions.py turns the torch one into torch_dist and that back into torch at
TP 2 x PP 2, every tensor equal; tools/convert_checkpoint.py --from megatron --to hf reads the
torch_dist checkpoint directly and writes the weights it writes from the torch one. A
torch_dist checkpoint given to merge_mp_partitions.py --ckpt-format torch_dist is a one-line
error.
"""
import os

import pytest
import torch

from tests.distributed.run_ranks import run_ranks
from tests.gpt_setup import one_thread, preprocess_wiki, tiny_gpt_argv



def _train(rank, world_size, prefix, workdir):
    import pretrain_gpt
    for name, extra in (("torch", []), ("dist", ["--ckpt-format", "torch_dist"])):
        pretrain_gpt.main(tiny_gpt_argv(prefix, os.path.join(workdir, "cache"), "--eval-iters",
                                        "0", "--tensor-model-parallel-size", "2", "--save",
                                        os.path.join(workdir, name), *extra, layers=2, iters=2))


def _full(root):
    from megatron.checkpointing import api
    return api.read_model(root)[0]


def _safetensors(directory):
    from safetensors.torch import load_file
    return load_file(os.path.join(directory, "model.safetensors"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist-convert")
    run_ranks(_train, 2, preprocess_wiki(out, docs=4), str(out), timeout=300)
    return str(out)


def test_merge_mp_partitions_converts_both_ways(saved, capsys):
    from tools import merge_mp_partitions
    torch_dir = os.path.join(saved, "torch")
    to_dist, back = os.path.join(saved, "to-dist"), os.path.join(saved, "back")
    with one_thread():
        assert merge_mp_partitions.main(["--load", torch_dir, "--save", to_dist,
                                         "--ckpt-format", "torch_dist"]) == 0
        assert os.path.isfile(os.path.join(to_dist, "iter_0000002", "metadata.json"))
        assert merge_mp_partitions.main(["--load", to_dist, "--save", back,
                                         "--target-tensor-model-parallel-size", "2",
                                         "--target-pipeline-model-parallel-size", "2"]) == 0
        assert sorted(os.listdir(os.path.join(back, "iter_0000002"))) == [
            "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
        original, converted = _full(torch_dir), _full(to_dist)
        returned = _full(back)
        returned.pop("word_embeddings_for_head.weight", None)
        assert sorted(original) == sorted(converted) == sorted(returned)
        for name, tensor in original.items():
            assert torch.equal(tensor, converted[name]), name
            assert torch.equal(tensor, returned[name]), name
        assert merge_mp_partitions.main(["--load", to_dist, "--save", back + "2",
                                         "--ckpt-format", "torch_dist"]) == 2
    assert "nothing to convert" in capsys.readouterr().err


def test_convert_checkpoint_to_hf_reads_torch_dist(saved):
    from tools import convert_checkpoint
    hf_dist, hf_torch = os.path.join(saved, "hf-dist"), os.path.join(saved, "hf-torch")
    with one_thread():
        for load, save in ((os.path.join(saved, "dist"), hf_dist),
                           (os.path.join(saved, "torch"), hf_torch)):
            assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load", load,
                                            "--save", save]) == 0
    ours, reference = _safetensors(hf_dist), _safetensors(hf_torch)
    assert sorted(ours) == sorted(reference)
    different = [name for name in ours if not torch.equal(ours[name], reference[name])]
    # the two runs trained the same model on the same batches: same weights
    assert not different, different
