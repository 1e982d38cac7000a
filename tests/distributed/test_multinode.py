"""Two torchrun agents on this machine as two nodes (c10d rendezvous on the loopback),
training a tiny GPT with one pipeline stage per node: the losses match one process."""
import os
import re
import signal
import subprocess
import sys

import pytest

import pretrain_gpt
from tests.conftest import ROOT
from tests.distributed.run_ranks import _free_port
from tests.gpt_setup import losses, one_thread, preprocess_wiki, tiny_gpt_argv

TIMEOUT = 240


def _agent(port: int, argv: list, log):
    """One node: a torchrun agent with one worker, in its own process group."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
               "--max-restarts", "0", str(ROOT / "pretrain_gpt.py"), *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                            start_new_session=True)


def test_two_torchrun_agents_train_at_pp2_like_one_process(tmp_path):
    prefix = preprocess_wiki(tmp_path, docs=100)
    argv = tiny_gpt_argv(prefix, tmp_path / "cache", "--eval-iters", "0", layers=2, mbs=2, gbs=4, iters=3)
    with one_thread():
        reference = losses(pretrain_gpt.main(argv))
    port = _free_port()
    logs = [open(tmp_path / f"node{i}.log", "w+") for i in range(2)]
    agents = [_agent(port, argv + ["--pipeline-model-parallel-size", "2"], log) for log in logs]
    try:
        for agent in agents:
            assert agent.wait(timeout=TIMEOUT) == 0
    finally:
        for agent in agents:  # the agents and their workers, whatever happened
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    output = "".join(open(log.name).read() for log in logs)
    found = [float(v) for v in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", output)]
    assert len(found) == 3, output[-3000:]
    assert found == pytest.approx(reference, rel=1e-5)
