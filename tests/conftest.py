"""Shared pytest set-up: the repository on sys.path, the oracles' mark and the run's
oracles line (tests/oracles.py)."""
import os
import sys

from tests import oracles
from tests.data_setup import ROOT, SHARED_DATA, reference_file  # noqa: F401  (re-exported)

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The fused kernels' choices by their fixed rules, not timed on a loaded machine: tests that
# check which path runs stay reproducible (spawned ranks inherit it). Tests of the measured
# choice set auto themselves (tests/unit/test_kernel_choice.py).
os.environ.setdefault("MEGATRON_FUSED_KERNELS_CHOICE", "rule")


def pytest_configure(config):
    config.addinivalue_line("markers", "oracle(*names): the test checks against these peers "
                            "(tests/oracles.py); it skips without them, or fails under "
                            f"{oracles.STRICT_ENV}=1")


def pytest_runtest_setup(item):
    for mark in item.iter_markers("oracle"):
        for name in mark.args:
            oracles.require(name, item.nodeid)


def pytest_runtest_logreport(report):
    if report.skipped:
        oracles.SKIPPED.add(report.nodeid)


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(oracles.summary())
