"""Training jobs on the test bed: torchrun agents (c10d rendezvous) or srun-style tasks, one
set per host, and what their logs say."""
import os
import subprocess
import re
import sys
import time
from typing import Dict, List

from tests.conftest import ROOT

RDZV_PORT = 29400
LOSS = re.compile(r"\| lm loss: ([0-9.E+-]+) \|")


def job_env(**extra) -> Dict[str, str]:
    """The environment of a rank on the bed: one thread, this checkout, gloo on eth0."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="eth0")
    env.update(extra)
    return env


def torchrun_argv(nnodes: int, nproc: int, endpoint: str, argv: List[str],
                  rdzv_id="bed-job", extra=()) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
            "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{endpoint}:{RDZV_PORT}", "--rdzv-id", rdzv_id,
            "--max-restarts", "0", *extra, str(ROOT / "pretrain_gpt.py"), *map(str, argv)]


def start_torchrun(bed, argv, log_dir, nproc=2, env=None, nnodes=None, extra=()) -> list:
    """One torchrun agent per host of `bed`, the first host holding the rendezvous (started
    last: the others wait for its store, so all join the first round); returns (host,
    process, log path) per host, in the bed's order."""
    started = {}
    for host in reversed(bed.names):
        path = os.path.join(str(log_dir), f"{host}.log")
        command = torchrun_argv(nnodes or len(bed.names), nproc, bed.names[0], argv, extra=extra)
        with open(path, "w") as log:
            proc = bed.popen(host, command, stdout=log, stderr=log, env=env or job_env(),
                             cwd=str(ROOT))
        started[host] = (host, proc, path)
    return [started[host] for host in bed.names]


def wait_all(started, timeout) -> Dict[str, int]:
    """Exit status per host (None for one still running at the deadline)."""
    deadline = time.monotonic() + timeout
    codes = {}
    for host, proc, _ in started:
        try:
            codes[host] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:  # subprocess.TimeoutExpired: the bed kills it on exit
            codes[host] = None
    return codes


def logs(started) -> str:
    return "".join(f"==== {host}\n" + open(path).read() for host, _, path in started)


def logged_losses(text: str) -> List[float]:
    return [float(v) for v in LOSS.findall(text)]


def run_sbatch_script(bed, script, log_path, timeout, **env):
    """Run `script` (an sbatch script) as sbatch would on the bed's hosts: SLURM's job
    variables set, `srun` being tests/multinode/fake_srun.py. Returns the exit status (None
    past the timeout)."""
    bin_dir = launcher_bin(os.path.join(os.path.dirname(str(log_path)), "slurm-bin"))
    srun = os.path.join(bin_dir, "srun")
    with open(srun, "w") as f:
        f.write(f"#!/bin/sh\nexec {sys.executable} {ROOT / 'tests/multinode/fake_srun.py'} \"$@\"\n")
    os.chmod(srun, 0o755)
    names = bed.names
    base = job_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_SUBMIT_DIR=str(ROOT),
                   SLURM_JOB_ID="35", SLURM_JOB_NUM_NODES=str(len(names)),
                   BED_NAMESPACES=",".join(f"{n}={bed.namespaces[n]}" for n in names))
    base.update(env)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", str(script)], stdout=log, stderr=log, env=base,
                                cwd=str(ROOT), start_new_session=True)
        bed.procs.append(proc)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def find_rank(bed, rank: int, timeout=120):
    """(host, pid) of the pretrain_gpt.py process whose RANK is `rank`, once it exists."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for host in bed.names:
            for pid in bed.pids(host):
                try:
                    environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                    cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
                except OSError:
                    continue
                if f"RANK={rank}".encode() in environ and b"pretrain_gpt.py" in cmdline:
                    return host, pid
        time.sleep(0.2)
    raise AssertionError(f"no process of rank {rank} appeared on the bed")


def wait_for_text(path, text: str, timeout=240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in open(path).read():
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} never appeared in {path}")


def launcher_bin(directory) -> str:
    """A directory for PATH whose `python` and `torchrun` are this interpreter's."""
    os.makedirs(directory, exist_ok=True)
    torchrun = os.path.join(directory, "torchrun")
    with open(torchrun, "w") as f:
        f.write(f"#!/bin/sh\nexec {sys.executable} -m torch.distributed.run \"$@\"\n")
    os.chmod(torchrun, 0o755)
    python = os.path.join(directory, "python")
    if not os.path.exists(python):
        os.symlink(sys.executable, python)
    return str(directory)


def start_pods(bed, container, log_dir, nproc, **env):
    """The PyTorchJob `container` run on each host as the training operator runs its pods:
    the manifest's env (overridden by `env`) and the PET_* and legacy variables it sets."""
    bin_dir = launcher_bin(os.path.join(str(log_dir), "pod-bin"))
    started = []
    for rank, host in enumerate(bed.names):
        pod_env = job_env(PATH=f"{bin_dir}:{os.environ['PATH']}",
                          **{e["name"]: e["value"] for e in container["env"]})
        pod_env.update(env, PET_NNODES=str(len(bed.names)), PET_NPROC_PER_NODE=str(nproc),
                       PET_NODE_RANK=str(rank), PET_MASTER_ADDR=bed.names[0],
                       PET_MASTER_PORT="23456", MASTER_ADDR=bed.names[0], MASTER_PORT="23456",
                       WORLD_SIZE=str(len(bed.names)), RANK=str(rank))
        path = os.path.join(str(log_dir), f"{host}.log")
        with open(path, "w") as log:
            proc = bed.popen(host, [*container["command"], *container["args"]], stdout=log,
                             stderr=log, env=pod_env, cwd=str(ROOT))
        started.append((host, proc, path))
    return started
