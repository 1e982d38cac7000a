"""The test bed itself: hosts with their own addresses, hostnames and hosts files, that
reach each other and nothing else, and leave nothing behind."""
import subprocess
import sys

from tests.multinode.bed import leftovers, test_bed

RESOLVE = "import socket; print(socket.gethostname(), socket.gethostbyname(socket.gethostname()), " \
          "socket.gethostbyname('node02'))"


def test_hosts_have_their_own_names_addresses_and_loopback():
    with test_bed(["node01", "node02"]) as bed:
        out = bed.run("node01", [sys.executable, "-c", RESOLVE])
        assert out.stdout.split() == ["node01", "10.77.0.1", "10.77.0.2"], out.stderr
        assert bed.run("node02", ["hostname"]).stdout.strip() == "node02"
        assert subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip() \
            not in ("node01", "node02")  # the machine's own name is untouched
        links = bed.run("node02", ["ip", "-o", "link"]).stdout
        assert "lo:" in links and "eth0@" in links and "state UP" in links.split("lo:")[1]
        assert bed.reachable("node01", "node02")
        # nothing outside the bed is reachable: the only route is the bed's subnet
        routes = bed.run("node01", ["ip", "route"]).stdout
        assert "default" not in routes and "10.77.0.0/24" in routes, routes


def test_leaving_the_bed_removes_namespaces_files_and_processes():
    with test_bed(["node01", "node02"]) as bed:
        sleeper = bed.popen("node02", ["sleep", "600"])
        assert bed.pids("node02")
    assert sleeper.poll() is not None
    assert leftovers(bed) == {"namespaces": [], "files": []}


def test_a_host_cut_off_the_switch_cannot_reach_the_other():
    with test_bed(["node01", "node02"]) as bed:
        bed.link("node02", up=False)
        assert not bed.reachable("node01", "node02", timeout=1.0)
        bed.link("node02", up=True)
        assert bed.reachable("node01", "node02")


def test_without_namespaces_the_bed_skips_in_one_line(monkeypatch):
    import os
    import pytest
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.skip.Exception) as skipped:
        with test_bed(["node01"]):
            pass
    assert str(skipped.value) == "multi-host test bed unavailable: not root"
