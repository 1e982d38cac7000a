"""A multi-host test bed: hosts as Linux network namespaces on one switch.

Each host is a network namespace with loopback up and one interface `eth0` (a veth pair
whose other end sits on a bridge inside a switch namespace of its own: nothing is added to
the machine's own network stack). A host has its own address (10.77.0.N/24), its own
hostname (a UTS namespace per command, `unshare --uts`) and a hosts file naming every host
(/etc/netns/<namespace>/hosts, which `ip netns exec` bind-mounts over /etc/hosts).

    with test_bed(["node01", "node02"]) as bed:
        proc = bed.popen("node01", ["hostname"], stdout=...)

Leaving the block SIGKILLs every process in the namespaces and deletes them (their veths and
the bridge go with them) and the hosts files. `test_bed` skips the test, with one line,
where namespaces cannot be made (not root, no `ip`/`unshare`, a container without the
capability).
"""
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List

import pytest

SUBNET = "10.77.0"
_serial = itertools.count()
_LISTEN = ("import socket, sys; s = socket.create_server(('', int(sys.argv[1]))); "
           "print('listening', flush=True); s.accept()")
_CONNECT = ("import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), "
            "timeout=float(sys.argv[3]))")


def _ip(*args, check=True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _unavailable() -> str:
    """Why namespaces cannot be made here ('' when they can)."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command"
    probe = f"mnprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return (made.stderr.strip().splitlines() or ["ip netns add failed"])[-1]
    uts = subprocess.run(["ip", "netns", "exec", probe, "unshare", "--uts", "true"],
                         capture_output=True, text=True)
    _ip("netns", "del", probe, check=False)
    if uts.returncode != 0:
        return "unshare --uts failed: " + (uts.stderr.strip() or "?")
    return ""


class Bed:
    """Hosts by name: namespace, address; `popen` runs a command on one of them."""

    def __init__(self, names: List[str], tag: str):
        self.names = list(names)
        self.tag = tag
        self.switch = f"{tag}sw"
        self.namespaces = {name: f"{tag}h{i}" for i, name in enumerate(names)}
        self.addresses = {name: f"{SUBNET}.{i + 1}" for i, name in enumerate(names)}
        self.procs: List[subprocess.Popen] = []

    def hosts_file(self) -> str:
        lines = ["127.0.0.1 localhost"] + [f"{a} {n}" for n, a in self.addresses.items()]
        return "\n".join(lines) + "\n"

    def command(self, host: str, argv: List[str]) -> List[str]:
        """`argv` run on `host`: in its namespace, under its own hostname."""
        return ["ip", "netns", "exec", self.namespaces[host], "unshare", "--uts", "sh", "-c",
                f'hostname {host} && exec "$@"', "sh", *map(str, argv)]

    def popen(self, host: str, argv: List[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(self.command(host, argv), start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, host: str, argv: List[str], timeout=30) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, argv), capture_output=True, text=True,
                              timeout=timeout)

    def pids(self, host: str) -> List[int]:
        """The processes living in `host`'s namespace."""
        out = _ip("netns", "pids", self.namespaces[host], check=False).stdout
        return [int(p) for p in out.split()]

    def kill(self, host: str) -> None:
        """Every process of `host` SIGKILLed at once, as when the machine dies."""
        for pid in self.pids(host):
            signal_quietly(pid, signal.SIGKILL)

    def reachable(self, source: str, target: str, port: int = 29999, timeout=2.0) -> bool:
        """Whether `source` opens a TCP connection to `target` (a listener started there)."""
        listener = self.popen(target, [sys.executable, "-c", _LISTEN, str(port)],
                              stdout=subprocess.PIPE, text=True)
        try:
            listener.stdout.readline()  # "listening"
            probe = self.run(source, [sys.executable, "-c", _CONNECT, target, str(port),
                                      str(timeout)], timeout=timeout + 10)
            return probe.returncode == 0
        finally:
            listener.kill()
            listener.wait()

    def link(self, host: str, up: bool) -> None:
        """Plug `host`'s cable in or out (its switch port goes down or up)."""
        _ip("-n", self.switch, "link", "set", f"p{self.names.index(host)}",
            "up" if up else "down")


def _build(bed: Bed) -> None:
    _ip("netns", "add", bed.switch)
    _ip("-n", bed.switch, "link", "add", "br0", "type", "bridge")
    _ip("-n", bed.switch, "link", "set", "br0", "up")
    for i, name in enumerate(bed.names):
        ns = bed.namespaces[name]
        _ip("netns", "add", ns)
        os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
        with open(f"/etc/netns/{ns}/hosts", "w") as f:
            f.write(bed.hosts_file())
        _ip("-n", bed.switch, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0",
            "netns", ns)
        _ip("-n", bed.switch, "link", "set", f"p{i}", "master", "br0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{bed.addresses[name]}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")


def signal_quietly(pid: int, sig: int) -> None:
    """Send `sig` to `pid`, which may have exited already."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _kill_all(bed: Bed) -> None:
    """SIGKILL everything in the namespaces, until nothing is left there."""
    for proc in bed.procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [p for host in bed.names for p in bed.pids(host)]
        if not left:
            break
        for pid in left:
            signal_quietly(pid, signal.SIGKILL)
        time.sleep(0.1)
    for proc in bed.procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def _remove(bed: Bed) -> None:
    for ns in [*bed.namespaces.values(), bed.switch]:
        _ip("netns", "del", ns, check=False)
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


@contextlib.contextmanager
def test_bed(names: List[str]):
    """A Bed of hosts `names` for the block; removed whatever happens. Skips where
    namespaces cannot be made."""
    why = _unavailable()
    if why:
        pytest.skip(f"multi-host test bed unavailable: {why}")
    bed = Bed(names, tag=f"mn{os.getpid()}x{next(_serial)}")
    try:
        _build(bed)
        yield bed
    finally:
        _kill_all(bed)
        _remove(bed)


test_bed.__test__ = False  # not a test for pytest's collector


def leftovers(bed: Bed) -> Dict[str, List[str]]:
    """What of `bed` still exists: namespaces, hosts-file directories."""
    listed = {line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines()
              if line.strip()}
    return {"namespaces": [ns for ns in [*bed.namespaces.values(), bed.switch] if ns in listed],
            "files": [ns for ns in bed.namespaces.values() if os.path.exists(f"/etc/netns/{ns}")]}
