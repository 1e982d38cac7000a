"""--universal-checkpoint (issue 11): a checkpoint saved at one TP / PP layout resumes at
another by re-sharding on load; without the flag the layout mismatch stays a one-line error.

One spawn of 2 gloo ranks saves the tiny GPT at TP=2 and at PP=2 and resumes the PP=2
checkpoint at TP=2. The parent resumes both at TP=1 and compares the first resumed loss with
the same checkpoint re-sharded by tools/merge_mp_partitions.py.
"""
import os

import pytest

import pretrain_gpt
from tests.distributed.run_ranks import run_ranks
from tests.gpt_setup import losses, one_thread, preprocess_wiki, tiny_gpt_argv
from tools import merge_mp_partitions


def _argv(tmp, prefix, *extra, iters):
    return tiny_gpt_argv(prefix, os.path.join(tmp, "cache"), "--eval-iters", "0", *extra,
                         layers=2, iters=iters)


def _worker(rank, world_size, tmp, prefix):
    with one_thread():
        for name, layout in (("tp2", ["--tensor-model-parallel-size", "2"]),
                             ("pp2", ["--pipeline-model-parallel-size", "2"])):
            pretrain_gpt.main(_argv(tmp, prefix, *layout, "--save", os.path.join(tmp, name),
                                    iters=2))
        resumed = pretrain_gpt.main(_argv(tmp, prefix, "--tensor-model-parallel-size", "2",
                                          "--load", os.path.join(tmp, "pp2"),
                                          "--universal-checkpoint", "--override-lr-scheduler",
                                          iters=3))
    return [h["iteration"] for h in resumed.history], losses(resumed)


def test_universal_checkpoint_reshards_on_load(tmp_path, capsys):
    tmp = str(tmp_path)
    (tmp_path / "corpus").mkdir()
    prefix = preprocess_wiki(tmp_path / "corpus", docs=4)
    iterations, pp2_at_tp2 = run_ranks(_worker, 2, tmp, prefix, timeout=280)[-1]
    assert iterations == [3]
    with one_thread():
        with pytest.raises(SystemExit):  # without the flag: today's one-line error
            pretrain_gpt.main(_argv(tmp, prefix, "--load", os.path.join(tmp, "tp2"), iters=3))
        assert "merge_mp_partitions" in capsys.readouterr().err
        universal = pretrain_gpt.main(_argv(tmp, prefix, "--load", os.path.join(tmp, "tp2"),
                                            "--universal-checkpoint", "--override-lr-scheduler",
                                          iters=3))
        assert "re-sharded" in capsys.readouterr().out
        merged = os.path.join(tmp, "tp2_merged")
        assert merge_mp_partitions.main(["--load", os.path.join(tmp, "tp2"), "--save", merged]) == 0
        reference = pretrain_gpt.main(_argv(tmp, prefix, "--load", merged, "--no-load-optim",
                                            iters=3))
        pp2_at_tp1 = pretrain_gpt.main(_argv(tmp, prefix, "--load", os.path.join(tmp, "pp2"),
                                             "--universal-checkpoint", "--override-lr-scheduler",
                                          iters=3))
    assert [h["iteration"] for h in universal.history] == [3]
    assert universal.consumed_train == 3 * 8
    assert losses(universal) == losses(reference)  # same weights, same batch
    assert pp2_at_tp2 == pytest.approx(losses(pp2_at_tp1), rel=1e-5)
