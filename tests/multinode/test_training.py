"""2 hosts x 2 ranks on the test bed, launched as users launch them, reproduce one process's
losses: TP 2 inside a host x DP 2 across hosts, PP 2 across hosts x DP 2 (1F1B and
interleaved), and srun-style tasks from SLURM's environment."""
import subprocess
import sys

import pytest
import yaml

import pretrain_gpt
from tests.conftest import ROOT
from tests.gpt_setup import losses, one_thread
from tests.multinode.bed import test_bed
from tests.multinode.jobs import (job_env, logged_losses, logs, run_sbatch_script, start_pods,
                                  start_torchrun, wait_all)
from tests.reliability_setup import byte_dataset, tiny_argv

TIMEOUT = 300  # the machine may be shared with a whole test-suite run
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


def assert_losses(text: str, reference) -> None:
    """Every iteration's logged loss equals the one-process run's."""
    found = logged_losses(text)
    assert len(found) == ITERS, text[-4000:]
    assert found == pytest.approx(reference, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_hosts_by_torchrun_match_one_process(job, layout, tmp_path):
    argv, reference = job
    with test_bed(["node01", "node02"]) as bed:
        started = start_torchrun(bed, argv + LAYOUTS[layout], tmp_path)
        codes = wait_all(started, TIMEOUT)
        text = logs(started)
    assert codes == {"node01": 0, "node02": 0}, text[-4000:]
    assert_losses(text, reference)


def test_srun_tasks_from_slurms_environment_match_one_process(job, tmp_path):
    """examples/pretrain_gpt_slurm.sh as sbatch runs it (SLURM_JOB_NODELIST=node[01-02], 2
    tasks per node, srun starting pretrain_gpt.py with no torchrun): TP 2 x DP 2."""
    argv, reference = job
    log = tmp_path / "sbatch.log"
    with test_bed(["node01", "node02"]) as bed:
        code = run_sbatch_script(bed, ROOT / "examples" / "pretrain_gpt_slurm.sh", log, TIMEOUT,
                                 SLURM_JOB_NODELIST="node[01-02]", SLURM_NTASKS_PER_NODE="2",
                                 TP="2", PP="1", GPT_ARGS=" ".join(argv), DATA_ARGS="",
                                 OUTPUT_ARGS="")
    text = log.read_text()
    assert code == 0, text[-4000:]
    assert_losses(text, reference)


@pytest.mark.parametrize("variable,flags", [("GLOO_SOCKET_IFNAME", []),
                                            ("NCCL_SOCKET_IFNAME", ["--distributed-backend", "nccl"])])
def test_an_interface_that_does_not_exist_fails_in_one_line(job, variable, flags):
    """A rank of host node01 (SLURM's environment) told to use eth9 stops before connecting,
    exit 2, in one line naming the host's interfaces (NCCL's name is checked before its GPUs
    are looked for, so on CPUs too)."""
    argv, _ = job
    argv = argv + flags
    env = job_env(SLURM_PROCID="0", SLURM_NTASKS="4", SLURM_LOCALID="0",
                  SLURM_NODELIST="node[01-02]", **{variable: "eth9"})
    with test_bed(["node01", "node02"]) as bed:
        proc = bed.popen("node01", [sys.executable, str(ROOT / "pretrain_gpt.py"), *argv],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         cwd=str(ROOT))
        _, err = proc.communicate(timeout=60)
    lines = err.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, err
    for word in (f"{variable}=eth9", "node01", "eth0, lo"):
        assert word in lines[0], lines[0]


def test_the_pytorchjob_pods_match_one_process(job, tmp_path):
    """examples/pretrain_gpt_pytorchjob.yaml's container, run on each host as the training
    operator runs a pod (PET_* for torchrun): TP 2 x DP 2."""
    argv, reference = job
    manifest = yaml.safe_load(open(ROOT / "examples" / "pretrain_gpt_pytorchjob.yaml"))
    container = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"][
        "containers"][0]
    with test_bed(["node01", "node02"]) as bed:
        started = start_pods(bed, container, tmp_path, nproc=2, TP="2", PP="1",
                             GPT_ARGS=" ".join(argv), DATA_ARGS="", OUTPUT_ARGS="")
        codes = wait_all(started, TIMEOUT)
        text = logs(started)
    assert codes == {"node01": 0, "node02": 0}, text[-4000:]
    assert_losses(text, reference)
