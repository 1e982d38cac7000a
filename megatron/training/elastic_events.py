"""What an elastic job's log says about its restarts, one line per event.

Under torchrun's elastic agent (`--nnodes MIN:MAX --max-restarts K`) a failed rank makes the
agent restart the job on the nodes left. The lines here say so from the restarted job's side:

- ` > restart 1 of at most 2 by torchrun's elastic agent, now at world size 1` at start-up;
- ` > resumed at iteration 4 with layout TP 1 x PP 1 x DP 1 (world size 1)` after --load
  (` > starting at iteration 0 from the weights of iteration 4 ...` with --finetune);
- and, for a rank whose peers went silent, whether its own host is the one cut off: a host
  that cannot reach the rendezvous store either cannot rejoin, so its agent, which would wait
  on that store, is stopped with it (`stop_cut_off_agent`).
"""
import os
import signal
import socket
from typing import List, Optional, Tuple

STORE_PROBE_SECONDS = 5.0


def restart_line(world_size: int) -> Optional[str]:
    """The restart line, or None in a job's first run (or outside torchrun)."""
    count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if count <= 0:
        return None
    most = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
    return (f" > restart {count} of at most {most} by torchrun's elastic agent, now at world "
            f"size {world_size}")


def layout_text(dims) -> str:
    """`TP 2 x PP 2 x DP 1 (world size 4)`, with CP, EP and virtual stages where used."""
    parts = [f"TP {dims.tp}", f"PP {dims.pp}"]
    if dims.virtual_pp:
        parts[-1] += f" (virtual {dims.virtual_pp})"
    parts += [f"CP {dims.cp}"] if dims.cp > 1 else []
    parts += [f"EP {dims.ep}"] if dims.ep > 1 else []
    return " x ".join(parts + [f"DP {dims.dp}"]) + f" (world size {dims.world_size})"


def resumed_line(iteration: int, dims, weights_of: Optional[int] = None) -> str:
    """The resume line; with `weights_of` (--finetune, or a release checkpoint) it says that
    only the weights of that saved iteration were taken and counting starts at `iteration`."""
    if weights_of is not None:
        return (f" > starting at iteration {iteration} from the weights of iteration "
                f"{weights_of} with layout {layout_text(dims)}")
    return f" > resumed at iteration {iteration} with layout {layout_text(dims)}"


def rendezvous_endpoint() -> Optional[Tuple[str, int]]:
    """(host, port) of the rendezvous this rank's torchrun agent was given (`--rdzv-endpoint`
    on its command line, else `$PET_RDZV_ENDPOINT`; port 29400 by default, as torchrun's);
    None outside an agent or without an endpoint."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    argv = _agent_argv()
    endpoint = os.environ.get("PET_RDZV_ENDPOINT", "")
    for i, arg in enumerate(argv):
        if arg in ("--rdzv-endpoint", "--rdzv_endpoint") and i + 1 < len(argv):
            endpoint = argv[i + 1]
        elif arg.startswith(("--rdzv-endpoint=", "--rdzv_endpoint=")):
            endpoint = arg.split("=", 1)[1]
    if not endpoint:
        return None
    host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "29400")
    return host.strip("[]"), int(port or 29400)


def unreachable_store() -> Optional[str]:
    """`host:port` of the agent's rendezvous when this host cannot open a connection to it
    within STORE_PROBE_SECONDS; None when it can, or when there is none to probe."""
    endpoint = rendezvous_endpoint()
    if endpoint is None:
        return None
    try:
        socket.create_connection(endpoint, timeout=STORE_PROBE_SECONDS).close()
        return None
    except OSError:
        return f"{endpoint[0]}:{endpoint[1]}"


def _agent_argv() -> List[str]:
    """The command line of this process's parent when it is torchrun's agent, else []."""
    try:
        argv = open(f"/proc/{os.getppid()}/cmdline", "rb").read().decode().split("\0")
    except OSError:
        return []
    runs = any(a.endswith("torchrun") or a == "torch.distributed.run" for a in argv[:3])
    return argv if runs else []


def stop_cut_off_agent() -> None:
    """SIGKILL this rank's torchrun agent (only a parent whose command line is torchrun's):
    cut off from its store, it would otherwise wait on it for minutes (its store calls do
    not time out on a dead link)."""
    parent = os.getppid()
    if "TORCHELASTIC_RUN_ID" in os.environ and parent > 1 and _agent_argv():
        os.kill(parent, signal.SIGKILL)
