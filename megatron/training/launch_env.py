"""What a launcher leaves in the environment, read before torch.distributed starts.

- SLURM without torchrun (`srun python pretrain_gpt.py ...`, one task per rank): RANK,
  WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from SLURM_PROCID, SLURM_NTASKS,
  SLURM_LOCALID and the first host of SLURM_NODELIST (bracket syntax: `node[01-02,05]`).
  Variables already set win, so torchrun started by srun is left alone.
- MPI without torchrun (`mpirun -np 8 python pretrain_gpt.py ...`): RANK, WORLD_SIZE and
  LOCAL_RANK from Open MPI's OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK} or MPICH / Intel MPI's
  PMI_RANK / PMI_SIZE (MPI_LOCALRANKID). MASTER_ADDR must be passed (`-x MASTER_ADDR=...`)
  unless every rank is on one host (Open MPI's local size equals the world size), where it
  is localhost; without it the run stops with one line instead of training as world 1.
- GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME: a name that matches no interface of this host
  is a ConfigError naming the interfaces that exist, before any connection is tried.

Pure functions of an environment mapping, apart from `apply_slurm_environment`.
"""
import os
import re
import socket
from typing import Dict, List, Mapping, Optional, Sequence

from megatron.config import ConfigError

DEFAULT_MASTER_PORT = 29500


class InterfaceError(ConfigError):
    """A socket interface variable names no interface of this host: printed by the first
    rank of each host (arguments.fail's per_host), since only that host knows."""
    per_host = True
_SLURM_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")


def _split_top_level(text: str) -> List[str]:
    """Split at the commas outside brackets: 'a[1-2,4],b' -> ['a[1-2,4]', 'b']."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise ConfigError(f"SLURM_NODELIST={text!r} has unbalanced brackets; expected e.g. "
                          "node[01-02,05]")
    return parts + [current]


def _expand_range(item: str, text: str) -> List[str]:
    """'01-03' -> ['01', '02', '03'] (the width of the first bound kept), '5' -> ['5']."""
    match = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
    if not match:
        raise ConfigError(f"SLURM_NODELIST={text!r}: {item!r} is not a number or a range "
                          "like 01-04")
    first, last = match.group(1), match.group(2) or match.group(1)
    if int(last) < int(first):
        raise ConfigError(f"SLURM_NODELIST={text!r}: the range {item!r} runs backwards")
    return [str(n).zfill(len(first)) for n in range(int(first), int(last) + 1)]


def expand_nodelist(text: str) -> List[str]:
    """SLURM's host list syntax expanded: 'node[01-02,05],gpu7' -> node01 node02 node05 gpu7;
    several bracket groups multiply out ('r[1-2]n[1-2]' -> r1n1 r1n2 r2n1 r2n2)."""
    hosts = []
    for part in _split_top_level(text.strip()):
        match = re.match(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not match:
            if part:
                hosts.append(part)
            continue
        prefix, ranges, rest = match.groups()
        tails = expand_nodelist(rest) if rest else [""]
        for item in _split_top_level(ranges):
            hosts += [prefix + number + tail for number in _expand_range(item, text)
                      for tail in tails]
    return hosts


def slurm_environment(env: Mapping[str, str]) -> Dict[str, str]:
    """The torch.distributed variables a task started by srun lacks (empty outside SLURM,
    or when RANK and WORLD_SIZE are already set, e.g. by torchrun under srun)."""
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return {}
    if "RANK" in env and "WORLD_SIZE" in env:
        return {}
    updates = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"],
               "LOCAL_RANK": env.get("SLURM_LOCALID", "0")}
    for name in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        if name in env and not env[name].isdigit():
            raise ConfigError(f"{name}={env[name]!r} is not a number; run the job with srun, "
                              "which sets it")
    if "MASTER_ADDR" not in env:
        nodelist = next((env[n] for n in _SLURM_NODELISTS if env.get(n)), None)
        if nodelist is None:
            raise ConfigError("SLURM_PROCID is set but SLURM_NODELIST is not; set MASTER_ADDR "
                              "to the first node's address, or launch with srun")
        updates["MASTER_ADDR"] = expand_nodelist(nodelist)[0]
    if "MASTER_PORT" not in env:
        updates["MASTER_PORT"] = str(DEFAULT_MASTER_PORT)
    return {key: value for key, value in updates.items() if key not in env}


_MPI = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"))
"""(rank, world size, local rank) variables of Open MPI and of MPICH / Intel MPI (PMI)."""


def mpi_environment(env: Mapping[str, str]) -> Dict[str, str]:
    """The torch.distributed variables a rank started by mpirun lacks (empty outside MPI, or
    when RANK and WORLD_SIZE are set already)."""
    names = next((n for n in _MPI if n[0] in env and n[1] in env), None)
    if names is None or ("RANK" in env and "WORLD_SIZE" in env):
        return {}
    rank, size, local = (env.get(n, "0") for n in names)
    for name, value in zip(names, (rank, size, local)):
        if not value.isdigit():
            raise ConfigError(f"{name}={value!r} is not a number; start the job with mpirun, "
                              "which sets it")
    updates = {"RANK": rank, "WORLD_SIZE": size, "LOCAL_RANK": local,
               "MASTER_PORT": str(DEFAULT_MASTER_PORT)}
    if "MASTER_ADDR" not in env:
        if env.get("OMPI_COMM_WORLD_LOCAL_SIZE") != size and size != "1":
            raise ConfigError(f"started by MPI ({names[1]}={size}) without MASTER_ADDR; pass "
                              "the first host's address (mpirun -x MASTER_ADDR=<host>) or "
                              "launch with torchrun")
        updates["MASTER_ADDR"] = "localhost"
    return {key: value for key, value in updates.items() if key not in env}


def apply_launcher_environment() -> Dict[str, str]:
    """Put slurm_environment(os.environ), else mpi_environment(os.environ), into os.environ;
    returns what it set."""
    updates = slurm_environment(os.environ) or mpi_environment(os.environ)
    os.environ.update(updates)
    return updates


def host_interfaces() -> List[str]:
    """The names of this host's network interfaces."""
    return sorted(name for _, name in socket.if_nameindex())


def _nccl_matches(spec: str, interfaces: Sequence[str]) -> bool:
    """NCCL_SOCKET_IFNAME semantics: comma-separated prefixes, '=' for exact names, a
    leading '^' excludes (an exclusion list always leaves something to try)."""
    if spec.startswith("^"):
        return True
    exact = spec.startswith("=")
    names = [n for n in spec.lstrip("=").split(",") if n]
    return any(i == n if exact else i.startswith(n) for n in names for i in interfaces)


def check_socket_ifnames(env: Mapping[str, str], interfaces: Sequence[str],
                         backend: str, hostname: Optional[str] = None) -> None:
    """Raise ConfigError when GLOO_SOCKET_IFNAME (every comma-separated name must exist;
    checked for any backend: gloo also carries CPU groups under nccl) or, with nccl,
    NCCL_SOCKET_IFNAME names no interface of this host."""
    host = hostname or socket.gethostname()
    have = ", ".join(interfaces)
    gloo = env.get("GLOO_SOCKET_IFNAME")
    if gloo:
        missing = [n for n in gloo.split(",") if n not in interfaces]
        if missing:
            raise InterfaceError(f"GLOO_SOCKET_IFNAME={gloo}: no interface {', '.join(missing)} on "
                              f"host {host}; its interfaces are: {have} (set it to one of them, "
                              "or unset it)")
    nccl = env.get("NCCL_SOCKET_IFNAME")
    if backend == "nccl" and nccl and not _nccl_matches(nccl, interfaces):
        raise InterfaceError(f"NCCL_SOCKET_IFNAME={nccl} matches no interface on host {host}; "
                          f"its interfaces are: {have} (set it to one of them, or unset it)")
