"""The ranks tier's fixture: ``worlds``, kept worlds of real gloo ranks shared by the whole session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ranks.worlds import DEFAULT_TIMEOUT, Worlds


@pytest.fixture(scope="session")
def worlds() -> Iterator[Worlds]:
    """``worlds.spawn(fn, nprocs, args=...)``: :func:`ringpipe.launch.spawn` on a world kept for the session."""
    kept = Worlds()
    yield kept
    kept.stop()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A check's timeout: a little less than its test's own (``@pytest.mark.timeout``, else
    ``--timeout``), so that a hung check fails naming the ranks still running before
    pytest-timeout ends the test. (A hook, not a fixture: hypothesis' tests take none per test.)"""
    marker = item.get_closest_marker("timeout")
    limit = marker.args[0] if marker is not None and marker.args else item.config.getoption("timeout", None)
    Worlds.timeout = max(1.0, float(limit) - 3.0) if limit else DEFAULT_TIMEOUT
