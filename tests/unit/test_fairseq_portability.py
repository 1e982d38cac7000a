"""A fairseq-converted checkpoint is portable (issue 33, item 5), on a tiny fairseq
`transformer_lm` written by hand (tests/fairseq_tiny.py: no fairseq, no ../shared data).

The dictionary and the GPT-2 BPE files given live inside the checkpoint (`fairseq/`) under
relative names: a moved checkpoint still samples and evaluates. A run continued from it
carries the "fairseq" entry and those files into its --save, so the continued checkpoint,
moved too, exports with `--to fairseq` (fairseq's settings kept, the trained weights).
Surplus model-parallel partitions are named "unexpected", missing ones "missing".
"""
import os
import shutil

import pytest
import torch

import pretrain_gpt
from megatron.checkpointing.megatron_legacy import safe_load
from megatron.checkpointing.portable import resolve_stored_paths
from tests import fairseq_tiny
from tests.gpt_setup import one_thread
from tools import convert_checkpoint


@pytest.fixture
def converted(tmp_path):
    """(the fairseq model.pt, our conversion of it), the BPE files removed afterwards."""
    source = fairseq_tiny.write_checkpoint(str(tmp_path / "fairseq_model"))
    vocab, merges = fairseq_tiny.write_bpe(str(tmp_path))
    save = str(tmp_path / "converted")
    assert convert_checkpoint.main(["--from", "fairseq", "--to", "megatron", "--load", source,
                                    "--save", save, "--vocab-file", vocab,
                                    "--merge-file", merges]) == 0
    os.remove(vocab)
    os.remove(merges)
    return source, save


def _moved(path: str, tmp_path, name: str) -> str:
    target = str(tmp_path / "elsewhere" / name)
    shutil.move(path, target)
    return target


def _stored_config(ckpt: str, iteration: str) -> dict:
    return safe_load(os.path.join(ckpt, iteration, "mp_rank_00", "model_optim_rng.pt"))["config"]


def _continue(load: str, save: str) -> None:
    with one_thread():
        pretrain_gpt.main(["--load", load, "--save", save, "--mock-data", "--micro-batch-size",
                           "2", "--global-batch-size", "2", "--seq-length", "16",
                           "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0",
                           "--num-workers", "0", "--log-interval", "1"])


def test_a_moved_checkpoint_samples_and_evaluates(converted, tmp_path, capsys):
    from tasks import main as tasks_main
    from tools import generate_samples_gpt
    _, save = converted
    data = _stored_config(save, "release")["data"]
    assert (data["tokenizer_model"], data["vocab_file"], data["merge_file"]) == (
        "fairseq/dict.txt", "fairseq/vocab.json", "fairseq/merges.txt")
    moved = _moved(save, tmp_path, "ckpt")
    text = tmp_path / "wiki.txt"
    text.write_text(" = Title = \n hello world , this is a test . \n")
    with one_thread():
        records = generate_samples_gpt.main(["--load", moved, "--prompt", "hello",
                                             "--out-seq-length", "8", "--greedy"])
        assert len(records) == 1 and records[0]["tokens"]
        metrics = tasks_main.main(["--task", "WIKITEXT103", "--valid-data", str(text),
                                   "--load", moved, "--seq-length", "16"])
    assert metrics and all(v == v for v in metrics.values())  # no nan
    assert "validation results on WIKITEXT103" in capsys.readouterr().out


def test_a_continued_checkpoint_exports_to_fairseq(converted, tmp_path):
    from megatron.checkpointing.fairseq import mapping
    from megatron.checkpointing.hf.convert import read_full_model
    from megatron.config import Config
    source, save = converted
    continued = str(tmp_path / "continued")
    _continue(_moved(save, tmp_path, "ckpt"), continued)
    stored = _stored_config(continued, "iter_0000002")
    assert stored["fairseq"]["dictionary"] == stored["data"]["tokenizer_model"] == "fairseq/dict.txt"
    assert sorted(os.listdir(os.path.join(continued, "fairseq"))) == [
        "dict.txt", "merges.txt", "vocab.json"]
    moved = _moved(continued, tmp_path, "continued")
    back = tmp_path / "back"
    assert convert_checkpoint.main(["--from", "megatron", "--to", "fairseq", "--load", moved,
                                    "--save", str(back)]) == 0
    original, exported = (torch.load(p, weights_only=True) for p in (source, back / "model.pt"))
    assert exported["cfg"] == original["cfg"]
    full, config = read_full_model(moved)
    rows = config["fairseq"]["vocab_rows"]
    trained = mapping.to_fairseq({n: t[:rows] if "word_embeddings" in n else t
                                  for n, t in full.items()}, Config.from_dict(config).model)
    assert sorted(exported["model"]) == sorted(original["model"])
    assert all(torch.equal(exported["model"][n], trained[n]) for n in trained)
    name = "decoder.layers.0.fc1.weight"
    assert not torch.equal(exported["model"][name], original["model"][name])  # it trained
    assert (back / "dict.txt").read_text() == (tmp_path / "fairseq_model" / "dict.txt").read_text()


def test_surplus_and_missing_partitions_are_named(tmp_path, capsys):
    source = fairseq_tiny.write_checkpoint(str(tmp_path / "single"))
    state = torch.load(source, weights_only=True)
    state["cfg"]["common"]["model_parallel_size"] = 2
    parts = tmp_path / "parts"
    parts.mkdir()
    shutil.copyfile(tmp_path / "single" / "dict.txt", parts / "dict.txt")
    for k in range(3):
        torch.save(state, parts / f"model-model_part-{k}.pt")

    def refused(words):
        assert convert_checkpoint.main(["--from", "fairseq", "--to", "megatron", "--load",
                                        str(parts), "--save", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err
    refused("partition(s) 2 unexpected for model-model_part-K.pt: its model_parallel_size is 2")
    os.remove(parts / "model-model_part-2.pt")
    os.remove(parts / "model-model_part-1.pt")
    refused("partition(s) 1 of 2 missing")
    assert not (tmp_path / "out").exists()


def test_absolute_names_of_a_moved_checkpoint_resolve_inside_it(tmp_path):
    """A checkpoint converted when the names were stored absolute, then moved."""
    (tmp_path / "new" / "fairseq").mkdir(parents=True)
    (tmp_path / "new" / "fairseq" / "dict.txt").write_text("32 1\n")
    old = str(tmp_path / "old" / "fairseq" / "dict.txt")
    stored = resolve_stored_paths({"data": {"tokenizer_model": old, "vocab_file": "/no/vocab.json"},
                                   "fairseq": {"dictionary": old}}, str(tmp_path / "new"))
    inside = str(tmp_path / "new" / "fairseq" / "dict.txt")
    assert stored["data"]["tokenizer_model"] == stored["fairseq"]["dictionary"] == inside
    assert stored["data"]["vocab_file"] == "/no/vocab.json"  # not the checkpoint's: untouched
