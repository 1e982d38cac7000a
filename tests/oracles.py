"""The reference implementations (../shared/references.md) that tests check our code
against, in one registry: every test that needs a peer asks for it here.

    pytestmark = oracles.needs("transformers")   # a module, or @oracles.needs(...) a test
    python = oracles.require("fairseq")           # inside a test: what the probe found

A peer that is absent skips the test with a reason naming it and how to install it, or
fails it under MEGATRON_REQUIRE_ORACLES=1 (which .ci/run sets), so CI never passes with an
oracle silently skipped. Each ask is recorded, and tests/conftest.py ends the run with one
line saying which oracles ran in how many tests and which skipped (`summary()`).
`python -m tests.oracles` checks that every peer is installed (tests/run_tests.sh).
"""
import functools
import importlib.metadata
import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Set

import pytest

STRICT_ENV = "MEGATRON_REQUIRE_ORACLES"


def _module(*names: str) -> Callable[[], Optional[str]]:
    def probe():
        return "installed" if all(importlib.util.find_spec(n) for n in names) else None
    return probe


def _fairseq():
    from tests.fairseq_ref import fairseq_python
    return fairseq_python()


def _megatron_core():
    from tests.mcore_setup import mcore_dir
    return mcore_dir()


def _deepspeed():
    return shutil.which("deepspeed") if importlib.util.find_spec("deepspeed") else None


@dataclass(frozen=True)
class Oracle:
    label: str  # as references.md names it
    distribution: str  # for its installed version
    install: str  # what installs it
    probe: Callable[[], Optional[str]]  # what a test gets, None when the peer is absent


ORACLES: Dict[str, Oracle] = {
    "megatron-core": Oracle("Megatron-Core", "megatron-core",
                            "pip install --no-deps megatron-core==0.16.1", _megatron_core),
    "fairseq": Oracle("fairseq", "fairseq-fixed", "bash tests/install_fairseq.sh", _fairseq),
    "deepspeed": Oracle("DeepSpeed", "deepspeed",
                        "pip install --no-deps --no-build-isolation deepspeed==0.19.8",
                        _deepspeed),
    "transformers": Oracle("transformers", "transformers", 'pip install -e ".[test]"',
                           _module("transformers", "safetensors")),
    "lm-eval": Oracle("lm-eval", "lm_eval", 'pip install -e ".[test]"', _module("lm_eval")),
}
ASKED: Dict[str, Dict[str, bool]] = {name: {} for name in ORACLES}  # nodeid -> installed
SKIPPED: Set[str] = set()  # nodeids of tests that skipped (for this reason or another)


@functools.lru_cache(maxsize=None)
def found(name: str) -> Optional[str]:
    return ORACLES[name].probe()


def strict() -> bool:
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def missing_reason(name: str) -> str:
    oracle = ORACLES[name]
    return f"the oracle {oracle.label} is not installed ({oracle.install})"


def require(name: str, nodeid: Optional[str] = None) -> str:
    """What the peer's probe found; skips the asking test when the peer is absent (fails it
    under MEGATRON_REQUIRE_ORACLES=1). Records the ask for the run's oracles line."""
    nodeid = nodeid or os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    value = found(name)
    ASKED[name][nodeid] = value is not None
    if value is None:
        if strict():
            pytest.fail(f"{missing_reason(name)}; {STRICT_ENV}=1 lets no oracle skip",
                        pytrace=False)
        pytest.skip(missing_reason(name))
    return value


def needs(*names: str):
    """A mark: the test (or every test of a module's `pytestmark`) asks for these peers
    before it runs (tests/conftest.py)."""
    for name in names:
        if name not in ORACLES:
            raise KeyError(f"unknown oracle {name!r}; known: {sorted(ORACLES)}")
    return pytest.mark.oracle(*names)


def _version(name: str) -> str:
    try:
        return " " + importlib.metadata.version(ORACLES[name].distribution)
    except importlib.metadata.PackageNotFoundError:  # fairseq lives in its own venv
        return ""


def summary() -> str:
    """One line: each oracle that ran, with its count of tests (asked, installed and not
    skipped for another reason, e.g. a missing reference file), those not installed with
    the count of tests that asked, and those that ran in no test."""
    ran, absent, idle = [], [], []
    for name, asks in ASKED.items():
        label = ORACLES[name].label
        count = sum(1 for nodeid, ok in asks.items() if ok and nodeid not in SKIPPED)
        if count:
            ran.append(f"{label}{_version(name)} ({count})")
        if not all(asks.values()):
            absent.append(f"{label} ({list(asks.values()).count(False)})")
        elif not count:
            idle.append(label)
    line = "oracles ran (tests): " + (", ".join(ran) or "none")
    if absent:
        line += "; NOT INSTALLED (tests that asked): " + ", ".join(absent)
    if idle:
        line += "; ran in no test: " + ", ".join(idle)
    return line


def main() -> int:
    """Exit 1 with one line naming the peers that are not installed."""
    absent = [name for name in ORACLES if found(name) is None]
    if not absent:
        print("oracles installed: " + ", ".join(o.label for o in ORACLES.values()))
        return 0
    print("oracles not installed: " + "; ".join(
        f"{ORACLES[n].label} ({ORACLES[n].install})" for n in absent), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
