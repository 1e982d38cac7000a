"""The launch environment (megatron/training/launch_env.py): SLURM's variables turned into
torch.distributed's, and socket interface names checked against the host's."""
import pytest

from megatron.config import ConfigError
from megatron.training.launch_env import (DEFAULT_MASTER_PORT, InterfaceError,
                                          check_socket_ifnames, expand_nodelist,
                                          mpi_environment, slurm_environment)


@pytest.mark.parametrize("text, hosts", [
    ("node[01-02,05]", ["node01", "node02", "node05"]),
    ("gpu7", ["gpu7"]),
    ("a[1-2],b[09-10]", ["a1", "a2", "b09", "b10"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("x-[3],y", ["x-3", "y"]),
])
def test_node_lists_expand_as_scontrol_show_hostnames(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text, word", [("node[01-02", "unbalanced"), ("node[a-b]", "'a-b'"),
                                        ("node[5-3]", "backwards")])
def test_bad_node_lists_name_the_value(text, word):
    with pytest.raises(ConfigError, match=word):
        expand_nodelist(text)


def test_an_srun_task_gets_rank_world_local_rank_and_the_first_node_as_master():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
           "SLURM_NODELIST": "node[01-02]", "SLURM_JOB_NODELIST": "other[1-9]"}
    assert slurm_environment(env) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                      "MASTER_ADDR": "node01",
                                      "MASTER_PORT": str(DEFAULT_MASTER_PORT)}


def test_what_is_set_already_wins_and_torchrun_under_srun_is_left_alone():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n[1-2]",
           "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "1234"}
    assert slurm_environment(env) == {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    assert slurm_environment(dict(env, RANK="5", WORLD_SIZE="8")) == {}
    assert slurm_environment({}) == {}


def test_an_srun_task_without_a_node_list_or_with_a_bad_rank_is_one_clear_error():
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        slurm_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    with pytest.raises(ConfigError, match="SLURM_PROCID='x'"):
        slurm_environment({"SLURM_PROCID": "x", "SLURM_NTASKS": "2", "SLURM_NODELIST": "a"})


def test_interface_names_are_checked_against_the_hosts():
    have = ["eth0", "ib0", "lo"]
    check_socket_ifnames({"GLOO_SOCKET_IFNAME": "eth0,ib0"}, have, "gloo")
    check_socket_ifnames({"NCCL_SOCKET_IFNAME": "eth9"}, have, "gloo")  # not used by gloo
    for nccl in ("ib", "=ib0", "^docker", "eth,ib"):
        check_socket_ifnames({"NCCL_SOCKET_IFNAME": nccl}, have, "nccl")
    with pytest.raises(InterfaceError) as err:
        check_socket_ifnames({"GLOO_SOCKET_IFNAME": "eth0,eth9"}, have, "gloo", hostname="h1")
    assert "GLOO_SOCKET_IFNAME=eth0,eth9: no interface eth9 on host h1" in str(err.value)
    assert "eth0, ib0, lo" in str(err.value) and err.value.per_host
    with pytest.raises(InterfaceError, match="NCCL_SOCKET_IFNAME==ib matches no interface"):
        check_socket_ifnames({"NCCL_SOCKET_IFNAME": "=ib"}, have, "nccl")


def test_an_mpirun_rank_gets_rank_world_and_local_rank():
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "MASTER_ADDR": "node01"}
    assert mpi_environment(ompi) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                     "MASTER_PORT": str(DEFAULT_MASTER_PORT)}
    assert mpi_environment({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
                            "MASTER_ADDR": "a", "MASTER_PORT": "7"}) == {
        "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    one_host = dict(ompi, OMPI_COMM_WORLD_LOCAL_SIZE="4")
    del one_host["MASTER_ADDR"]
    assert mpi_environment(one_host)["MASTER_ADDR"] == "localhost"
    assert mpi_environment(dict(ompi, RANK="0", WORLD_SIZE="4")) == {}  # torchrun under mpirun
    assert mpi_environment({}) == {}


def test_an_mpirun_job_across_hosts_without_master_addr_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"OMPI_COMM_WORLD_SIZE=4\) without MASTER_ADDR"):
        mpi_environment({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
                         "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    with pytest.raises(ConfigError, match="PMI_RANK='x'"):
        mpi_environment({"PMI_RANK": "x", "PMI_SIZE": "2", "MASTER_ADDR": "a"})
