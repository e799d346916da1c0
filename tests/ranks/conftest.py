"""The ranks tier's fixture: ``worlds``, kept worlds of real gloo ranks shared by the whole session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ranks.worlds import Worlds


@pytest.fixture(scope="session")
def worlds() -> Iterator[Worlds]:
    """``worlds.spawn(fn, nprocs, args=...)``: :func:`ringpipe.launch.spawn` on a world kept for the session."""
    kept = Worlds()
    yield kept
    kept.stop()
