"""The checkpoint front door (megatron/checkpointing/api.py) takes a new format as one module and
one registry line.

The format here is a throw-away: one safetensors file per model-parallel rank and a JSON file
of what is not a tensor. Registered with one line (the `registered` fixture), it is chosen by
--ckpt-format, detected at --load, saved (also by --async-save, which wraps any format) and
resumed exactly, re-sharded at load by --universal-checkpoint, and converted to and from the
torch format by tools/merge_mp_partitions.py, all without touching the framework's code.
"""
import json
import os

import pytest
import torch

import pretrain_gpt
from megatron.checkpointing import api, collectives, reshard
from megatron.checkpointing.formats import Found, RunState, Target
from megatron.checkpointing.io import CheckpointError
from megatron.checkpointing.model_file import to_megatron_layout
from megatron.checkpointing.tracker import iteration_dir, write_tracker
from tests.gpt_setup import losses, one_thread
from tools import merge_mp_partitions

safetensors = pytest.importorskip("safetensors.torch")
META = "meta.json"


class SafetensorsFormat:
    """iter_XXXXXXX/tp_TT_pp_PP.safetensors (this rank's weights) + meta.json (the rest)."""

    name = ckpt_format = "safetensors"
    reshards_on_load = False

    def detect(self, directory: str) -> bool:
        return os.path.isfile(os.path.join(directory, META))

    def stored_state(self, found: Found) -> dict:
        with open(os.path.join(found.directory, META)) as f:
            return json.load(f)

    def snapshot(self, root: str, iteration: int, run: RunState) -> dict:
        p, model = run.pstate, run.models[0]
        meta = {"iteration": iteration, "config": run.config.to_dict(),
                "consumed_train_samples": run.consumed_train,
                "consumed_valid_samples": run.consumed_valid,
                "sharding": model.sharding_metadata(),
                "parallel": {"tensor_model_parallel_size": p.tp_size,
                             "pipeline_model_parallel_size": p.pp_size}}
        return {"file": _rank_name(p.tp_rank, p.pp_rank) if p.dp_rank == 0 else None,
                "tensors": model.state_dict(), "meta": meta if p.rank == 0 else None}

    def write(self, root: str, iteration: int, snapshot: dict) -> None:
        directory = iteration_dir(root, iteration)
        os.makedirs(directory, exist_ok=True)
        if snapshot["file"]:
            safetensors.save_file({k: v.contiguous() for k, v in snapshot["tensors"].items()},
                                  os.path.join(directory, snapshot["file"]))
        collectives.barrier()
        if snapshot["meta"] is not None:
            with open(os.path.join(directory, META), "w") as f:
                json.dump(snapshot["meta"], f)
            write_tracker(root, iteration)
        collectives.barrier()

    def load(self, found: Found, run: RunState):
        p, meta = run.pstate, self.stored_state(found)
        if meta["parallel"] != {"tensor_model_parallel_size": p.tp_size,
                                "pipeline_model_parallel_size": p.pp_size}:
            raise CheckpointError(f"{found.directory} was saved at {meta['parallel']}; add "
                                  f"--universal-checkpoint")
        path = os.path.join(found.directory, _rank_name(p.tp_rank, p.pp_rank))
        run.models[0].load_state_dict(safetensors.load_file(path), strict=True)
        if run.optimizer is not None:
            run.optimizer.reload_model_params()
        return (meta["iteration"], meta["consumed_train_samples"],
                meta["consumed_valid_samples"])

    def read_model(self, found: Found):
        meta = self.stored_state(found)
        tp, pp = (meta["parallel"][f"{k}_model_parallel_size"] for k in ("tensor", "pipeline"))
        states = {(t, s): {"model": to_megatron_layout(safetensors.load_file(
            os.path.join(found.directory, _rank_name(t, s)))), "sharding": meta["sharding"],
            "config": meta["config"]} for t in range(tp) for s in range(pp)}
        source = reshard.Source(found.iteration, found.release, tp, pp, states)
        full = reshard.full_model(source)
        return full, dict(meta, sharding=source.sharding.to_dict(full))

    def write_model(self, save: str, full, stored: dict, target: Target) -> str:
        directory = iteration_dir(save, int(stored["iteration"]))
        os.makedirs(directory)
        for (t, s), flat in reshard.cut(full, stored, target.tp, target.pp).items():
            safetensors.save_file({k: v.contiguous() for k, v in flat.items()},
                                  os.path.join(directory, _rank_name(t, s)))
        meta = dict(stored, parallel={"tensor_model_parallel_size": target.tp,
                                      "pipeline_model_parallel_size": target.pp})
        with open(os.path.join(directory, META), "w") as f:
            json.dump({k: meta[k] for k in ("iteration", "config", "consumed_train_samples",
                                            "consumed_valid_samples", "sharding", "parallel")}, f)
        write_tracker(save, int(stored["iteration"]))
        return directory


def _rank_name(tp_rank: int, pp_rank: int) -> str:
    return f"tp_{tp_rank:02d}_pp_{pp_rank:02d}.safetensors"


TOY = SafetensorsFormat()


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(api, "FORMATS", [TOY] + api.FORMATS)  # the one registry line


def _argv(tmp_path, *extra, iters=4, weights_only=True):
    """A tiny run on synthetic tokens; `weights_only`: the toy format keeps no optimizer or
    RNG state."""
    only = ["--no-save-optim", "--no-load-optim", "--no-save-rng"] if weights_only else []
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", str(iters), "--lr", "1e-3",
            "--lr-warmup-fraction", "0.25", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "500", "--log-interval", "1", "--eval-iters", "0",
            "--num-workers", "0", "--use-cpu-initialization", "--hidden-dropout", "0",
            "--attention-dropout", "0", *only, "--data-cache-path", str(tmp_path / "cache"),
            "--seed", "7", *extra]


def _weights(root):
    return api.read_model(str(root))[0]


def test_a_registered_format_is_saved_detected_resumed_and_resharded(registered, tmp_path):
    with one_thread():
        full = pretrain_gpt.main(_argv(tmp_path))
        first = pretrain_gpt.main(_argv(tmp_path, "--ckpt-format", "safetensors", "--save",
                                        str(tmp_path / "toy"), "--save-interval", "2",
                                        "--exit-interval", "2"))
        assert sorted(os.listdir(tmp_path / "toy" / "iter_0000002")) == [
            META, "tp_00_pp_00.safetensors"]
        assert api.detect(str(tmp_path / "toy")).format is TOY
        resumed = pretrain_gpt.main(_argv(tmp_path, "--ckpt-format", "safetensors", "--load",
                                          str(tmp_path / "toy"), "--override-opt_param-scheduler"))
    assert losses(first) == losses(full)[:2]
    assert [h["iteration"] for h in resumed.history] == [3, 4]
    # the weights of iteration 2 re-cut for TP 2 and back, through the front door
    assert merge_mp_partitions.main(["--load", str(tmp_path / "toy"), "--save",
                                     str(tmp_path / "torch-tp2"), "--ckpt-format", "torch",
                                     "--target-tensor-model-parallel-size", "2"]) == 0
    assert sorted(os.listdir(tmp_path / "torch-tp2" / "iter_0000002")) == [
        "mp_rank_00", "mp_rank_01"]
    assert merge_mp_partitions.main(["--load", str(tmp_path / "torch-tp2"), "--save",
                                     str(tmp_path / "toy-tp2"), "--ckpt-format", "safetensors",
                                     "--target-tensor-model-parallel-size", "2"]) == 0
    assert api.detect(str(tmp_path / "toy-tp2")).format is TOY
    saved = _weights(tmp_path / "toy")
    for other in ("torch-tp2", "toy-tp2"):
        back = _weights(tmp_path / other)
        assert sorted(back) == sorted(saved)
        assert all(torch.equal(back[k], v) for k, v in saved.items()), other


def test_universal_load_and_async_save_take_the_new_format(registered, tmp_path):
    """A TP 2 checkpoint of the toy format resumes at TP 1 with --universal-checkpoint (the
    weights of iteration 2 exactly), and --async-save writes the toy format."""
    with one_thread():
        pretrain_gpt.main(_argv(tmp_path, "--ckpt-format", "safetensors", "--save",
                                str(tmp_path / "toy"), "--save-interval", "2", iters=2))
        assert api.convert(str(tmp_path / "toy"), str(tmp_path / "tp2"), "safetensors",
                           Target(tp=2)) == str(tmp_path / "tp2" / "iter_0000002")
        with pytest.raises(SystemExit):  # saved at TP 2: one line, exit 2
            pretrain_gpt.main(_argv(tmp_path, "--ckpt-format", "safetensors", "--load",
                                    str(tmp_path / "tp2"), "--finetune", iters=1))
        resumed = pretrain_gpt.main(_argv(tmp_path, "--ckpt-format", "safetensors", "--load",
                                          str(tmp_path / "tp2"), "--universal-checkpoint",
                                          "--override-opt_param-scheduler", iters=3))
        direct = pretrain_gpt.main(_argv(tmp_path, "--ckpt-format", "safetensors", "--load",
                                         str(tmp_path / "toy"), "--override-opt_param-scheduler",
                                         iters=3))
        assert losses(resumed) == losses(direct) and len(losses(resumed)) == 1
        pretrain_gpt.main(_argv(tmp_path, "--ckpt-format", "safetensors", "--async-save",
                                "--save", str(tmp_path / "async"), "--save-interval", "1",
                                iters=2))
    assert api.detect(str(tmp_path / "async")).iteration == 2
    synced, written = _weights(tmp_path / "toy"), _weights(tmp_path / "async")
    assert all(torch.equal(written[k], v) for k, v in synced.items())


def test_the_inference_entry_points_read_every_format(registered, tmp_path, capsys):
    """tools/generate_samples_gpt.py gives the same greedy tokens from the same weights saved
    as torch, torch_dist and the registered format (the loaders go through the front door)."""
    from tools import generate_samples_gpt
    samples = {}
    with one_thread():
        for name in ("torch", "torch_dist", "safetensors"):
            root = str(tmp_path / name)
            pretrain_gpt.main(_argv(tmp_path, "--ckpt-format", name, "--save", root, iters=2))
            out = str(tmp_path / f"{name}.jsonl")
            records = generate_samples_gpt.main(["--load", root, "--num-samples", "1",
                                                 "--top_k", "1", "--out-seq-length", "6",
                                                 "--sample-output-file", out])
            samples[name] = records[0]["text"]
    assert f"format {TOY.name}, saved at TP 1 x PP 1" in capsys.readouterr().out
    assert samples["torch"] == samples["torch_dist"] == samples["safetensors"], samples


def test_async_save_of_the_torch_format_writes_what_a_synchronous_save_writes(tmp_path):
    """--async-save wraps the torch format too: the same tensors, the same counters, resumable."""
    from megatron.checkpointing.model_file import read_model_file
    with one_thread():
        for name, extra in (("sync", []), ("async", ["--async-save"])):
            pretrain_gpt.main(_argv(tmp_path, "--save", str(tmp_path / name), "--save-interval",
                                    "1", *extra, iters=2, weights_only=False))
    path = os.path.join("iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    sync, written = (read_model_file(str(tmp_path / name / path)) for name in ("sync", "async"))
    assert sorted(sync) == sorted(written)
    flat = [(k, v) for k, v in _tensors(sync)]
    assert [k for k, _ in flat] == [k for k, _ in _tensors(written)]
    assert all(torch.equal(v, w) for (_, v), (_, w) in zip(flat, _tensors(written)))
    assert (written["iteration"], written["consumed_train_samples"]) == (2, 8)
    assert "optimizer" in written and "rng_state" in written


def _tensors(tree, path=""):
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, dict):
        for key in sorted(tree, key=str):
            yield from _tensors(tree[key], f"{path}/{key}")
    elif isinstance(tree, (list, tuple)):
        for i, item in enumerate(tree):
            yield from _tensors(item, f"{path}/{i}")


def test_the_universal_notice_names_the_expert_layout_when_it_changes():
    from megatron.checkpointing.universal import _layout_words
    split = None
    assert _layout_words((2, 1, 1, 1, 2, split), (1, 1, 1, 1, 1, split)) == ("TP 2 x PP 1",
                                                                             "TP 1 x PP 1")
    assert _layout_words((1, 1, 1, 1, 1, split), (1, 1, 1, 2, 1, split)) == (
        "TP 1 x PP 1 x EP 1", "TP 1 x PP 1 x EP 2")
    assert _layout_words((2, 1, 1, 2, 1, split), (2, 1, 1, 2, 2, split)) == (
        "TP 2 x PP 1 x EP 2 x ETP 1", "TP 2 x PP 1 x EP 2 x ETP 2")
