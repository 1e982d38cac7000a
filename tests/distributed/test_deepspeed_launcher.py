"""The seed README's DeepSpeed launch with the real `deepspeed` launcher (issue 22, 7).

`deepspeed --num_gpus 2 pretrain_gpt.py ... --deepspeed --deepspeed_config ds_config.json
--zero-stage 1 --distributed-backend gloo` on CPU: the launcher passes --local_rank and
sets the rendezvous environment; ZeRO 1 runs as our distributed optimizer. The run trains
and saves, a second launch resumes from the checkpoint, and the resumed losses are those
of the same 4 iterations in one process; each launch prints every line of its start-up once,
not once per rank. DeepSpeed is an oracle (tests/oracles.py; tests/run_tests.sh installs it).
"""
import json
import os
import re
import subprocess

from tests import oracles
from tests.conftest import ROOT
from tests.distributed.test_launch_notices import assert_each_line_once
from tests.gpt_setup import losses, one_thread

pytestmark = oracles.needs("deepspeed")

TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "63", "--lr", "1e-3",
        "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--use-cpu-initialization"]
DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 4,
             "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
             "zero_optimization": {"stage": 1}, "fp16": {"enabled": False},
             "steps_per_print": 2000, "wall_clock_breakdown": False}


def launch(tmp_path, *flags) -> str:
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(DS_CONFIG))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["deepspeed", "--num_gpus", "2", "pretrain_gpt.py", *TINY, *flags,
                           "--deepspeed", "--deepspeed_config", str(config), "--zero-stage", "1",
                           "--distributed-backend", "gloo"], cwd=ROOT, env=env, timeout=400,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def logged_losses(out: str):
    return [float(v) for v in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", out)]


def test_deepspeed_launcher_trains_saves_and_resumes(tmp_path):
    import pretrain_gpt
    save = str(tmp_path / "ckpt")
    first = launch(tmp_path, "--train-iters", "4", "--save", save, "--exit-interval", "2")
    assert first.count("ZeRO stage 1 runs as --use-distributed-optimizer") == 1
    assert len(logged_losses(first)) == 2
    resumed = launch(tmp_path, "--train-iters", "4", "--save", save, "--load", save)
    assert f" loading checkpoint from {save} at iteration 2 (format torch, saved at TP 1 x " \
           f"PP 1)" in resumed
    for out in (first, resumed):  # start-up notices once per launch, not once per rank
        assert_each_line_once(out)
    assert " training from iteration 2 to 4" in resumed
    with one_thread():
        whole = losses(pretrain_gpt.main(TINY + ["--train-iters", "4", "--micro-batch-size", "1",
                                                 "--global-batch-size", "4"]))
    ours = logged_losses(first) + logged_losses(resumed)
    assert len(ours) == 4
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ours, whole)), (ours, whole)
