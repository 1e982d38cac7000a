"""Hosts that fail, in the test bed (issue 35, item 3): an elastic job (`--nnodes 1:2
--max-restarts 2`) that loses a host ends restarted on the host that is left, resumed from
the last complete checkpoint at the new world size, and finished, with the losses and the
sample order of an uninterrupted run."""
import os
import re
import time

import pytest

import pretrain_gpt
from tests.gpt_setup import losses, one_thread
from tests.multinode.bed import test_bed
from tests.multinode.jobs import start_torchrun, wait_all
from tests.reliability_setup import byte_dataset, tiny_argv

ITERS = 8
LINE = re.compile(r" iteration +(\d+)/ +\d+ \| consumed samples: +(\d+) \|.*?\| lm loss: "
                  r"([0-9.E+-]+) \|")
ELASTIC = ["--rdzv-conf", "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"]


def _latest(save) -> int:
    try:
        return int(open(os.path.join(str(save), "latest_checkpointed_iteration.txt")).read())
    except (OSError, ValueError):
        return 0


def test_a_killed_host_ends_in_a_restarted_resumed_finished_job(tmp_path):
    prefix = byte_dataset(tmp_path, docs=60)
    argv = tiny_argv(prefix, tmp_path / "cache", iters=ITERS)  # micro 2, global 4
    with one_thread():
        reference = losses(pretrain_gpt.main(argv))
    save = tmp_path / "ckpt"
    job = argv + ["--save", save, "--load", save, "--save-interval", "2"]
    with test_bed(["node01", "node02"]) as bed:
        started = start_torchrun(bed, job, tmp_path, nproc=1, nnodes="1:2",
                                 extra=["--max-restarts", "2", *ELASTIC])
        deadline = time.monotonic() + 240
        while _latest(save) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _latest(save) >= 2, open(started[0][2]).read()[-3000:]
        killed_at = _latest(save)
        bed.kill("node02")
        codes = wait_all(started[:1], 300)
        survivor = open(started[0][2]).read()
        lost = open(started[1][2]).read()
    assert codes == {"node01": 0}, survivor[-4000:]
    assert re.search(r"successfully loaded checkpoint from .* at iteration (\d+)", survivor)
    resumed = int(re.findall(r"successfully loaded checkpoint from .* at iteration (\d+)",
                             survivor)[-1])
    assert resumed >= killed_at
    final = {}  # iteration -> (consumed samples, loss), the restarted run's where repeated
    for text in (lost, survivor):
        for iteration, consumed, loss in LINE.findall(text):
            final[int(iteration)] = (int(consumed), float(loss))
    assert sorted(final) == list(range(1, ITERS + 1)), survivor[-4000:]
    assert [final[i][0] for i in sorted(final)] == [4 * i for i in range(1, ITERS + 1)]
    assert [final[i][1] for i in sorted(final)] == pytest.approx(reference, rel=1e-5, abs=1e-6)
