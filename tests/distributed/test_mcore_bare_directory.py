"""A bare directory of Megatron-Core's `dist_checkpointing.save` (metadata.json, .metadata,
__*.distcp, common.pt holding {}; no tracker, no iter_*, no checksums: what Megatron-Core and
the tools built on it hand to users) is a checkpoint to every entry point (issue 33, item 4).

Megatron-Core 0.16.1 writes it once (one spawned gloo rank, its local-spec GPT of 2 layers,
hidden 64). Then, in this process: `--load DIR` and `--load ROOT/iter_0000005` load it with a
one-line notice and no "starting from scratch", without --no-verify-checkpoint (its files are
read unverified, as Megatron-LM's legacy files are); a root that holds it as an iteration
directory without a tracker is refused in one line naming the directory to pass;
`tools/merge_mp_partitions.py` and `tools/convert_checkpoint.py --to hf` take the model flags it
lacks, and the re-sharded torch checkpoint trains as the directory itself does.
"""
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

import pretrain_gpt
from megatron.checkpointing import api
from tests.distributed.run_ranks import run_ranks
from tests.gpt_setup import assert_exits_2_with_one_line, losses, one_thread
from tests import oracles
from tools import convert_checkpoint, merge_mp_partitions

pytestmark = oracles.needs("megatron-core")

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--max-position-embeddings", "16"]


def _save_bare(rank, world_size, directory):
    from tests.mcore_setup import import_mcore, mcore_gpt
    import_mcore()
    from megatron.core import dist_checkpointing
    torch.manual_seed(1)
    model = mcore_gpt(1, 2, 64, 4, 128, 16, share_embeddings_and_output_weights=True,
                      activation_func=lambda x: F.gelu(x, approximate="tanh"))
    os.makedirs(directory)
    dist_checkpointing.save(model.sharded_state_dict(), directory)
    return sorted(os.listdir(directory))


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("mcore") / "bare")
    names = run_ranks(_save_bare, 1, directory, timeout=600)[0]
    assert "metadata.json" in names and "common.pt" in names and not any(
        n.startswith("latest") for n in names), names
    assert torch.load(os.path.join(directory, "common.pt"), weights_only=True) == {}
    return directory


def _argv(tmp_path, *extra):
    return [*MODEL, "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "127", "--log-interval", "1", "--eval-iters", "0",
            "--num-workers", "0", "--use-cpu-initialization", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--data-cache-path", str(tmp_path / "cache"),
            "--seed", "7", *extra]


def _train(tmp_path, capsys, *extra):
    with one_thread():
        history = losses(pretrain_gpt.main(_argv(tmp_path, *extra)))
    return history, capsys.readouterr().out


def test_bare_directory_and_iteration_directory_load_with_a_notice(bare, tmp_path, capsys):
    fresh, _ = _train(tmp_path, capsys)
    direct, out = _train(tmp_path, capsys, "--load", bare, "--ckpt-format", "torch_dist")
    assert f" > {bare} has no latest_checkpointed_iteration.txt: it is loaded as one " \
           f"torch_dist checkpoint directory, iteration 0" in out, out
    assert "starting from scratch" not in out and direct != fresh, out
    root = tmp_path / "root"
    shutil.copytree(bare, root / "iter_0000005")
    given, out = _train(tmp_path, capsys, "--load", str(root / "iter_0000005"),
                        "--ckpt-format", "torch_dist")
    assert "it is loaded as one torch_dist checkpoint directory, iteration 5" in out, out
    assert given == direct
    assert_exits_2_with_one_line(capsys, lambda: pretrain_gpt.main(_argv(
        tmp_path, "--load", str(root), "--ckpt-format", "torch_dist")), [
        f"{root} holds iter_0000005 but no latest_checkpointed_iteration.txt; pass --load "
        f"{root / 'iter_0000005'}"])


def test_tools_take_the_model_flags_it_lacks(bare, tmp_path, capsys):
    out = str(tmp_path / "torch")
    assert merge_mp_partitions.main(["--load", bare, "--save", out]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "stores no model configuration" in err, err
    assert "--num-layers" in err, err
    assert merge_mp_partitions.main(["--load", bare, "--save", out, *MODEL,
                                     "--tensor-model-parallel-size", "1"]) == 0
    theirs, _ = api.read_model(bare, {"num_layers": 2, "hidden_size": 64, "seq_length": 16,
                                      "num_attention_heads": 4, "max_position_embeddings": 16})
    ours, stored = api.read_model(out)
    assert api.detect(bare).format.name == "torch_dist"
    assert stored["config"]["model"]["padded_vocab_size"] == 128  # the embedding's rows
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)
    direct, _ = _train(tmp_path, capsys, "--load", bare, "--ckpt-format", "torch_dist")
    merged, _ = _train(tmp_path, capsys, "--load", out, "--finetune")
    assert merged == direct
    assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load", bare, "--save",
                                    str(tmp_path / "hf"), *MODEL, "--hf-vocab-size", "128"]) == 0
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors")
