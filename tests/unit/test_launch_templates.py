"""The launch templates users copy (issue 35): the Kubernetes PyTorchJob manifest has the
fields the Kubeflow training operator requires and flags that fit its world size; the SLURM
sbatch script leaves the ranks to SLURM's own variables (the SLURM path of launch_env)."""
import os
import shlex
import subprocess

import pytest
import yaml

import pretrain_gpt
from megatron.arguments import parse_args
from megatron.training.launch_env import slurm_environment
from tests.conftest import ROOT

MANIFEST = ROOT / "examples" / "pretrain_gpt_pytorchjob.yaml"
RESTART_POLICIES = {"Always", "OnFailure", "Never", "ExitCode"}


def manifest():
    with open(MANIFEST) as f:
        return yaml.safe_load(f)


def pod_command(container) -> list:
    """The container's command line with its env values substituted (as bash -c would)."""
    env = {e["name"]: e["value"] for e in container["env"]}
    assert container["command"] == ["bash", "-c"] and len(container["args"]) == 1
    line = container["args"][0]
    for name, value in sorted(env.items(), key=lambda kv: -len(kv[0])):
        line = line.replace(f'"${name}"', shlex.quote(value)).replace(f"${name}", value)
    return shlex.split(line)


def test_the_pytorchjob_has_what_the_training_operator_requires():
    job = manifest()
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert job["metadata"]["name"]
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    for spec in specs.values():
        assert spec["restartPolicy"] in RESTART_POLICIES and spec["replicas"] >= 1
        containers = spec["template"]["spec"]["containers"]
        pytorch = [c for c in containers if c["name"] == "pytorch"]  # the operator's name
        assert len(pytorch) == 1 and pytorch[0]["image"]
        ports = {p["name"]: p["containerPort"] for p in pytorch[0].get("ports", [])}
        assert ports.get("pytorchjob-port") == 23456
        names = {e["name"] for e in pytorch[0]["env"]}
        assert {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"} <= names


def test_the_pytorchjob_flags_parse_for_its_world_size():
    job = manifest()
    specs = job["spec"]["pytorchReplicaSpecs"]
    world = int(job["spec"]["nprocPerNode"]) * sum(s["replicas"] for s in specs.values())
    command = pod_command(specs["Worker"]["template"]["spec"]["containers"][0])
    assert command[:2] == ["torchrun", "pretrain_gpt.py"]  # launcher flags from PET_* env
    config, _ = parse_args(command[2:], world_size=world, required=pretrain_gpt.REQUIRED)
    p = config.parallel
    assert world % (p.tensor_model_parallel_size * p.pipeline_model_parallel_size) == 0
    assert config.data.data_path and config.logging.log_straggler


def test_the_sbatch_script_leaves_the_ranks_to_slurms_variables(tmp_path):
    """srun gets pretrain_gpt.py itself (no torchrun, no RANK/MASTER_ADDR set by the
    script): each task's rank, world size and master come from SLURM's variables."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$RECORD"\n'
                                  'env > "$RECORD.env"\n')
    (bin_dir / "srun").chmod(0o755)
    record = tmp_path / "argv"
    env = {k: v for k, v in os.environ.items() if k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", RECORD=str(record), DATA="d", VOCAB="v",
               MERGE="m", SLURM_JOB_NUM_NODES="3", SLURM_NTASKS_PER_NODE="8",
               SLURM_JOB_NODELIST="gpu[07-08,11]")
    subprocess.run(["bash", str(ROOT / "examples" / "pretrain_gpt_slurm.sh")], env=env,
                   check=True, timeout=60)
    argv = record.read_text().splitlines()
    assert argv[:6] == ["--nodes", "3", "--ntasks-per-node", "8", "--export=ALL", "python"]
    assert argv[6] == "pretrain_gpt.py"
    task_env = dict(line.split("=", 1) for line in open(f"{record}.env").read().splitlines()
                    if "=" in line)
    assert not {"RANK", "WORLD_SIZE", "MASTER_ADDR"} & set(task_env)
    # what srun adds for task 9 (node 1, local task 1), and what pretrain_gpt.py makes of it
    task_env.update(SLURM_PROCID="9", SLURM_NTASKS="24", SLURM_LOCALID="1",
                    SLURM_NODELIST=task_env["SLURM_JOB_NODELIST"])
    assert slurm_environment(task_env) == {"RANK": "9", "WORLD_SIZE": "24", "LOCAL_RANK": "1",
                                           "MASTER_ADDR": "gpu07", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("name", ["pretrain_gpt_pytorchjob.yaml", "pretrain_gpt_slurm.sh"])
def test_the_readme_multinode_section_shows_the_template(name):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Multi-node", 1)[1].split("\n## ", 1)[0]
    assert f"examples/{name}" in section
