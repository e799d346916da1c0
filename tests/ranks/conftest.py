"""The ranks tier's fixture: ``worlds``, kept worlds of real gloo ranks shared by the whole session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ranks.worlds import DEFAULT_TIMEOUT, Worlds


@pytest.fixture(scope="session")
def kept_worlds() -> Iterator[Worlds]:
    """One :class:`~ranks.worlds.World` per size, started when first asked for, stopped at the end."""
    kept = Worlds()
    yield kept
    kept.stop()


@pytest.fixture
def worlds(kept_worlds: Worlds, request: pytest.FixtureRequest) -> Worlds:
    """``worlds.spawn(fn, nprocs, args=...)``: :func:`ringpipe.launch.spawn` on a world kept for the session.

    A check's timeout defaults to a little less than the test's own (``@pytest.mark.timeout``,
    else ``--timeout``), so that a hung check fails naming the ranks still running, before
    pytest-timeout ends the test.
    """
    marker = request.node.get_closest_marker("timeout")
    limit = marker.args[0] if marker is not None and marker.args else request.config.getoption("timeout", None)
    kept_worlds.timeout = max(1.0, float(limit) - 3.0) if limit else DEFAULT_TIMEOUT
    return kept_worlds
