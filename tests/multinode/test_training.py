"""2 hosts x 2 ranks on the test bed, launched as users launch them, reproduce one process's
losses: TP 2 inside a host x DP 2 across hosts, PP 2 across hosts x DP 2 (1F1B and
interleaved), and srun-style tasks from SLURM's environment."""
import pytest

import pretrain_gpt
from tests.gpt_setup import losses, one_thread
from tests.multinode.bed import test_bed
from tests.multinode.jobs import logged_losses, logs, start_torchrun, wait_all
from tests.reliability_setup import byte_dataset, tiny_argv

TIMEOUT = 180
ITERS = 3


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """(flags of the tiny run, one process's losses with them)."""
    out = tmp_path_factory.mktemp("multinode")
    prefix = byte_dataset(out, docs=60)
    argv = tiny_argv(prefix, out / "cache", iters=ITERS, layers=4)
    argv[argv.index("--micro-batch-size") + 1] = "1"
    argv[argv.index("--global-batch-size") + 1] = "8"
    with one_thread():
        reference = losses(pretrain_gpt.main(argv))
    assert len(reference) == ITERS
    return argv, reference


LAYOUTS = {
    "tp2-inside-hosts-dp2-across": ["--tensor-model-parallel-size", "2"],
    "pp2-across-hosts-dp2-1f1b": ["--pipeline-model-parallel-size", "2"],
    "pp2-across-hosts-dp2-interleaved": ["--pipeline-model-parallel-size", "2",
                                         "--num-layers-per-virtual-pipeline-stage", "1"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_hosts_by_torchrun_match_one_process(job, layout, tmp_path):
    argv, reference = job
    with test_bed(["node01", "node02"]) as bed:
        started = start_torchrun(bed, argv + LAYOUTS[layout], tmp_path)
        codes = wait_all(started, TIMEOUT)
        text = logs(started)
    assert codes == {"node01": 0, "node02": 0}, text[-4000:]
    found = logged_losses(text)
    assert len(found) == ITERS, text[-4000:]
    assert found == pytest.approx(reference, rel=1e-5, abs=1e-6)
