"""A stand-in for `srun` on the test bed: starts `--ntasks-per-node` tasks of the command on
each of `--nodes` hosts (namespaces from BED_NAMESPACES, `host=namespace,...`, in the order
of SLURM_JOB_NODELIST), with the variables srun gives a task, and exits with the worst status.
Used as `srun` on PATH when tests/multinode runs examples/pretrain_gpt_slurm.sh."""
import os
import subprocess
import sys


def parse(argv):
    nodes, per_node, rest = 1, 1, list(argv)
    while rest and rest[0].startswith("-"):
        flag = rest.pop(0)
        if flag in ("--nodes", "-N"):
            nodes = int(rest.pop(0))
        elif flag == "--ntasks-per-node":
            per_node = int(rest.pop(0))
        elif not flag.startswith("--export"):
            sys.exit(f"fake srun: unexpected flag {flag}")
    return nodes, per_node, rest


def main():
    nodes, per_node, command = parse(sys.argv[1:])
    hosts = [pair.split("=") for pair in os.environ["BED_NAMESPACES"].split(",")][:nodes]
    procs = []
    for node, (host, namespace) in enumerate(hosts):
        for local in range(per_node):
            env = dict(os.environ, SLURM_PROCID=str(node * per_node + local),
                       SLURM_LOCALID=str(local), SLURM_NTASKS=str(nodes * per_node),
                       SLURM_NODEID=str(node), SLURM_NNODES=str(nodes),
                       SLURM_NODELIST=os.environ["SLURM_JOB_NODELIST"])
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", namespace, "unshare", "--uts", "sh", "-c",
                 f'hostname {host} && exec "$@"', "sh", *command], env=env))
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
