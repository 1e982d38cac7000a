"""End-to-end training on real text: loss falls, checkpoints resume exactly."""
import math
import os

import numpy as np
import pytest
import torch

import pretrain_gpt
from megatron.checkpointing import megatron_legacy
from megatron.checkpointing import api
from megatron.checkpointing.io import CheckpointError
from megatron.checkpointing.model_file import from_megatron_layout, to_megatron_layout
from megatron.checkpointing.torch_format import read_rank_file
from megatron.mpu import single_process_state
from tests.data_setup import SHARED_DATA, corpus_file
from tests.gpt_setup import losses, preprocess_wiki, tiny_gpt_argv



@pytest.fixture(scope="module")
def wiki(tmp_path_factory):
    out = tmp_path_factory.mktemp("wiki")
    return preprocess_wiki(out), out / "cache"


def unigram_entropy(prefix) -> float:
    """Nats per token of the corpus's own token frequencies: the loss of a model that
    ignores the context."""
    from megatron.data.indexed_dataset import MMapIndexedDataset
    data = MMapIndexedDataset(prefix)
    counts = np.bincount(np.concatenate([np.asarray(data[i]) for i in range(len(data))]))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def test_loss_falls_below_6_in_200_iterations(wiki):
    """The foundation's acceptance run: 4 layers, hidden 128, 4 heads, seq 128, batch 8. On
    WikiText the loss falls below 6; on any corpus (the built one of a clone without
    ../shared: 6.10 against its unigram 6.60) at least 0.4 nats below the unigram
    entropy (WikiText's: 6.51), so the model has learned from the context."""
    prefix, cache = wiki
    argv = tiny_gpt_argv(prefix, cache, "--log-interval", "50", "--eval-interval", "200",
                         "--eval-iters", "2", hidden=128, seq=128, mbs=8, gbs=8, iters=200)
    state = pretrain_gpt.main(argv)
    curve = losses(state)
    final = sum(curve[-10:]) / 10
    assert curve[0] > math.log(8000) - 0.5
    assert final < unigram_entropy(prefix) - 0.4, (final, curve[-10:])
    if corpus_file().is_relative_to(SHARED_DATA):  # WikiText's validation articles
        assert final < 6.0, curve[-10:]
    assert state.validation and state.validation[-1]["lm loss"] < 6.5


def test_resume_reproduces_uninterrupted_losses(wiki, tmp_path):
    prefix, cache = wiki
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]  # RNG must resume too
    full = losses(pretrain_gpt.main(tiny_gpt_argv(prefix, cache, *dropout, iters=40)))
    save = str(tmp_path / "ckpt")
    first = pretrain_gpt.main(tiny_gpt_argv(prefix, cache, *dropout, "--save", save,
                                            "--save-interval", "20", "--exit-interval", "20", iters=40))
    assert losses(first) == full[:20]
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "20"
    assert os.path.isfile(os.path.join(save, "iter_0000020", "mp_rank_00", "model_optim_rng.pt"))
    resumed = pretrain_gpt.main(tiny_gpt_argv(prefix, cache, *dropout, "--load", save, iters=40))
    assert [h["iteration"] for h in resumed.history] == list(range(21, 41))
    assert losses(resumed) == full[20:]


def test_finetune_and_layout_errors(wiki, tmp_path, capsys):
    prefix, cache = wiki
    save = str(tmp_path / "ckpt")
    pretrain_gpt.main(tiny_gpt_argv(prefix, cache, "--save", save, "--no-save-optim", iters=2))
    capsys.readouterr()
    state = pretrain_gpt.main(tiny_gpt_argv(prefix, cache, "--load", save, "--finetune", iters=2))
    assert [h["iteration"] for h in state.history] == [1, 2]
    assert " > starting at iteration 0 from the weights of iteration 2 with layout TP 1 x " \
           "PP 1 x DP 1 (world size 1)" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # saved without optimizer: one-line error, exit 1
        pretrain_gpt.main(tiny_gpt_argv(prefix, cache, "--load", save, iters=4))
    pp2 = single_process_state()
    pp2.dims = type(pp2.dims)(world_size=2, tp=1, pp=2)
    with pytest.raises(CheckpointError, match="merge_mp_partitions"):
        read_rank_file(api.detect(save), pp2)


def test_checkpoint_loads_with_weights_only_and_megatron_keys(wiki, tmp_path):
    prefix, cache = wiki
    save = str(tmp_path / "ckpt")
    pretrain_gpt.main(tiny_gpt_argv(prefix, cache, "--save", save, iters=1))
    path = os.path.join(save, "iter_0000001", "mp_rank_00", "model_optim_rng.pt")
    state = megatron_legacy.safe_load(path)  # weights_only, with the Namespace allowlist
    model = state["model"]["language_model"]
    assert set(model) == {"embedding", "encoder"}
    assert model["embedding"]["word_embeddings"]["weight"].shape == (8000, 64)
    assert "layers.3.self_attention.query_key_value.weight" in model["encoder"]
    assert "final_layernorm.weight" in model["encoder"]
    flat = from_megatron_layout(state["model"])
    assert to_megatron_layout(flat).keys() == state["model"].keys()
    assert state["iteration"] == 1 and state["config"]["model"]["num_layers"] == 4


def test_interrupted_save_keeps_previous_checkpoint(wiki, tmp_path, monkeypatch):
    prefix, cache = wiki
    save = str(tmp_path / "ckpt")
    pretrain_gpt.main(tiny_gpt_argv(prefix, cache, "--save", save, iters=1))

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed while saving")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        pretrain_gpt.main(tiny_gpt_argv(prefix, cache, "--load", save, "--save", save,
                                        "--override-lr-scheduler", iters=2))
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "1"
    monkeypatch.undo()
    # more iterations change the lr schedule: Megatron's flag to take the new one
    state = pretrain_gpt.main(tiny_gpt_argv(prefix, cache, "--load", save, "--override-lr-scheduler",
                                            iters=2))
    assert [h["iteration"] for h in state.history] == [2]


def test_tensorboard_scalars(wiki, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    prefix, cache = wiki
    tb = tmp_path / "tb"
    pretrain_gpt.main(tiny_gpt_argv(prefix, cache, "--tensorboard-dir", str(tb), "--eval-interval", "2",
                                    "--log-batch-size-to-tensorboard",
                                    "--log-validation-ppl-to-tensorboard", iters=4))
    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "grad-norm", "batch-size", "lm loss validation",
            "lm loss validation ppl"} <= tags
    assert [e.step for e in events.Scalars("lm loss")] == [1, 2, 3, 4]


def test_missing_vocab_file_is_one_line(wiki, tmp_path, capsys):
    prefix, cache = wiki
    argv = tiny_gpt_argv(prefix, cache, "--vocab-file", str(tmp_path / "nope.json"))
    with pytest.raises(SystemExit) as exc:
        pretrain_gpt.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nope.json" in err


def test_training_runs_without_a_compiler(wiki, tmp_path):
    """No fused kernels and no C++ helpers can be built: one warning each, same training."""
    import subprocess
    import sys
    from tests.conftest import ROOT
    prefix, _ = wiki
    env = dict(os.environ, MEGATRON_DISABLE_FUSED_BUILD="1", MEGATRON_FUSED_BUILD_DIR=str(tmp_path / "b"),
               PYTHONWARNINGS="default")
    argv = tiny_gpt_argv(prefix, tmp_path / "cache", "--attention-impl", "fused", iters=3)
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *argv], env=env,
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count(" iteration ") >= 3
    fused_warnings = [l for l in proc.stderr.splitlines() if "fused kernels" in l and "Warning" in l]
    assert len(fused_warnings) == 1, proc.stderr[-2000:]


def test_timing_log_level_prints_phase_times(wiki, capsys):
    prefix, cache = wiki
    pretrain_gpt.main(tiny_gpt_argv(prefix, cache, "--timing-log-level", "2", iters=2))
    timing = [l for l in capsys.readouterr().out.splitlines() if l.startswith(" time (ms) |")]
    assert len(timing) == 2
    for phase in ("forward-compute", "backward-compute", "optimizer", "grads-all-reduce"):
        assert f"{phase}: " in timing[0], timing[0]
