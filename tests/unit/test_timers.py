"""Timer levels: which timers record (and synchronise the device) at each --timing-log-level."""
import itertools

import pytest

from megatron.pipeline.p2p import exchange_name
from megatron.training import logging as training_logging
from megatron.training.logging import Timers


def exchange_names():
    """Every name the pipeline's p2p exchanges time under."""
    names = {exchange_name(*flags) for flags in itertools.product((False, True), repeat=4)}
    return sorted(n for n in names if n)


@pytest.fixture
def sync_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(training_logging, "_sync", lambda: calls.append(1))
    return calls


def run_timer(timers, name):
    timers(name).start()
    timers(name).stop()


def test_combined_exchange_timers_do_not_sync_below_level_2(sync_calls):
    names = exchange_names()
    assert "forward-send-backward-recv" in names and "backward-send-forward-recv" in names
    for level in (0, 1):
        timers = Timers(level)
        for name in names + ["some-timer-nobody-listed"]:
            run_timer(timers, name)
        assert sync_calls == [] and timers.pop_all() == {}


def test_combined_exchange_timers_record_at_level_2(sync_calls):
    timers = Timers(2)
    for name in exchange_names():
        run_timer(timers, name)
    assert set(timers.pop_all()) == set(exchange_names())
    assert len(sync_calls) == 2 * len(exchange_names())


@pytest.mark.parametrize("level", [0, 1, 2])
def test_listed_timers_follow_their_level(level, sync_calls):
    timers = Timers(level)
    for name in Timers.LEVELS:
        run_timer(timers, name)
    expected = {name for name, lvl in Timers.LEVELS.items() if lvl <= level}
    assert set(timers.pop_all()) == expected
    assert len(sync_calls) == 2 * len(expected)
