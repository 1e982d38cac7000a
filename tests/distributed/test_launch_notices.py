"""Start-up notices appear once per launch, not once per rank (issue 33, item 8).

Notices printed before the process group exists (DeepSpeed JSON mapping, the --save lock)
go by the launcher's RANK; the ones after it (fp16 on a CPU, the padded vocabulary, the
paths the kernels take, the training range) by the process group's rank 0. Under the
legacy `python -m torch.distributed.launch` (which passes --local-rank to each rank), two
ranks print every line of their start-up and training once. The deepspeed launcher's run
is checked the same way in test_deepspeed_launcher.py.
"""
import json
import re
import socket
import subprocess
import sys
from collections import Counter

from tests.conftest import ROOT
from tests.reliability_setup import one_thread_env

TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "63", "--lr", "1e-3",
        "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--use-cpu-initialization",
        "--distributed-backend", "gloo"]
LAUNCHER_LOG = re.compile(r"^(\[\d{4}-\d\d-\d\d |[WIE]\d{4} )")
"""Lines the launchers themselves log (DeepSpeed's [date] lines, torch's W1202 lines)."""


def assert_each_line_once(out: str) -> None:
    """Every line our ranks print (the launchers' own log lines aside) appears once."""
    lines = [line for line in out.splitlines() if line.strip() and not LAUNCHER_LOG.match(line)]
    repeated = [line for line, count in Counter(lines).items() if count > 1]
    assert not repeated, out[-3000:]


def test_torch_distributed_launch_prints_each_notice_once(tmp_path):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "train_batch_size": 4,
                                  "zero_optimization": {"stage": 1}, "fp16": {"enabled": True},
                                  "prescale_gradients": False}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node", "2",
         "--master_port", str(port), "pretrain_gpt.py", *TINY, "--train-iters", "2",
         "--deepspeed", "--deepspeed_config", str(config), "--save", str(tmp_path / "ckpt")],
        cwd=ROOT, env=one_thread_env(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for notice in ("ZeRO stage 1 runs as --use-distributed-optimizer",
                   "keys not used here: prescale_gradients", "WARNING: --fp16 on a CPU",
                   " > padded vocab", " training from iteration 0 to 2", " attention: ",
                   " saved checkpoint at iteration       2"):
        assert out.count(notice) == 1, (notice, out[-3000:])
    assert_each_line_once(out + done.stderr)


def test_ranks_started_as_mpirun_starts_them_train_as_one_job(tmp_path):
    """Two plain `python pretrain_gpt.py` processes with only Open MPI's variables (what
    `mpirun -np 2` on one host gives each rank; no RANK / WORLD_SIZE / MASTER_ADDR) form one
    world of 2 and print each line once, rather than training as two worlds of 1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in one_thread_env().items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    procs = [subprocess.Popen(
        [sys.executable, "pretrain_gpt.py", *TINY, "--train-iters", "2",
         "--micro-batch-size", "1", "--global-batch-size", "2"], cwd=ROOT,
        env=dict(env, OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE="2",
                 OMPI_COMM_WORLD_LOCAL_RANK=str(r), OMPI_COMM_WORLD_LOCAL_SIZE="2",
                 MASTER_PORT=str(port)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    # as two worlds of 1, each would be a rank 0 (the training range) and a last rank (the
    # iteration lines)
    assert " training from iteration 0 to 2" in outs[0] and "training from" not in outs[1]
    assert " iteration        2/       2 |" in outs[1] and "2/       2 |" not in outs[0]
