"""The unit tier starts no process: a test here that does fails and says where it belongs.

A test of this folder marked ``e2e`` (it runs ``ringpipe`` in a fresh interpreter, say) may
start processes; it runs with the end-to-end tier.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess

import pytest

MESSAGE = ("a unit test starts no process: mark it @pytest.mark.e2e or move it to tests/ranks "
           "(a world of ranks) or tests/e2e (launchers, the trainer, TensorFlow)")


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError(MESSAGE)


@pytest.fixture(autouse=True)
def no_processes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("e2e") is not None:
        return
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuse)
