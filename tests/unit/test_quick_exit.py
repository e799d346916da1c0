"""``RINGPIPE_QUICK_EXIT``: garbage is finalized as usual at exit, only what is still alive is frozen."""

import atexit
import gc

import pytest

from ringpipe import quick_exit


@pytest.mark.parametrize(("value", "asked"), [("1", True), (" on ", True), ("yes", True), ("TRUE", True),
                                              ("", False), ("0", False), ("off", False)])
def test_the_variable_asks_for_it(value, asked):
    assert quick_exit.requested({quick_exit.QUICK_EXIT: value}) is asked
    assert quick_exit.requested({}) is False  # off by default


def test_install_registers_one_exit_handler_only_when_asked(monkeypatch):
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(quick_exit, "_INSTALLED", [False])
    monkeypatch.delenv(quick_exit.QUICK_EXIT, raising=False)
    assert quick_exit.install() is False and registered == []
    monkeypatch.setenv(quick_exit.QUICK_EXIT, "1")
    assert quick_exit.install() is True and quick_exit.install() is True
    assert registered == [quick_exit._collect_then_freeze]  # once


def test_the_exit_handler_finalizes_garbage_then_freezes_what_is_alive():
    finalized = []

    class Node:
        def __del__(self):
            finalized.append(1)

    garbage = Node()
    garbage.me = garbage  # a cycle: only the collector frees it
    del garbage
    alive = Node()
    try:
        quick_exit._collect_then_freeze()
        assert finalized == [1]  # garbage at exit is finalized as without the option
        assert gc.get_freeze_count() > 0
        assert alive is not None and finalized == [1]  # what is alive stays alive
    finally:
        gc.unfreeze()
