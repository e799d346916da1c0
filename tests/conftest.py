"""The suite's three tiers, marked by folder, and the helper modules every tier imports.

``tests/unit`` starts no process, ``tests/ranks`` runs multi-rank checks on worlds of real
processes (``tests/ranks/worlds.py``), ``tests/e2e`` starts launchers, the trainer, TensorFlow,
MPI jobs and namespace hosts. Each test gets its folder's marker (``unit``, ``ranks`` or ``e2e``);
a test of ``unit`` or ``ranks`` that starts a job the way ``e2e`` does (marked ``e2e``, ``mpi``
for ``mpirun`` or ``netns`` for namespace hosts) or runs as long (``slow``) is marked ``e2e``
instead, so that
``pytest -m "not e2e"`` is the inner loop and plain ``pytest`` still runs everything. Where the
``-m`` expression leaves out every ``e2e`` test, ``tests/e2e`` is not even imported (its modules
import TensorFlow and the trainer: half a minute of collection saved).

``./run.sh test`` runs the suite on several pytest-xdist workers (``--dist loadgroup``): each test
file is a group, kept on one worker, and the tests of a session fixture that runs shared jobs are
one group (:data:`SHARED_JOBS`). Plain ``pytest`` runs in one process, as before.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "ranks", "e2e")
#: Markers that mean a job started as the end-to-end tier starts them (mpirun, namespace hosts), or
#: a run as long as theirs (``slow``: an exhaustive sweep of several minutes).
E2E_MARKERS = ("e2e", "mpi", "netns", "slow")

# Every process the suite starts that imports ringpipe skips the interpreter's last garbage
# collections over torch's objects at exit (src/ringpipe/quick_exit.py): 0.5-1.5 s of CPU a process.
os.environ.setdefault("RINGPIPE_QUICK_EXIT", "1")

# The helper modules (netns, sshhosts, tf_ranks, trainrun) and the rank scripts (scripts.*) are
# imported by tests of every folder.
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from mpi_ranks import MPIJobs  # noqa: E402 (found on the path just set)


def tier_of(item: pytest.Item) -> str | None:
    """The tier a collected test belongs to: its folder's, or ``e2e`` where it starts such a job."""
    try:
        folder = Path(str(item.path)).resolve().relative_to(TESTS).parts[0]
    except ValueError:
        return None
    if folder not in TIERS:
        return None
    if folder != "e2e" and any(item.get_closest_marker(m) is not None for m in E2E_MARKERS):
        return "e2e"
    return folder


def _selects_e2e(markexpr: str) -> bool:
    """Whether ``-m markexpr`` may select a test marked ``e2e`` (with or without other markers)."""
    if not markexpr.strip():
        return True
    from _pytest.mark.expression import Expression

    expr = Expression.compile(markexpr)
    others = {"cuda", "mpi", "netns", "slow"}  # a test marked e2e is never marked unit or ranks
    cases = [set(), others, *({m} for m in others)]
    return any(expr.evaluate(lambda name, on=on: name == "e2e" or name in on) for on in cases)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path == TESTS / "e2e" and not _selects_e2e(config.getoption("markexpr") or ""):
        return True
    return None


#: Session fixtures whose tests run on one worker under pytest-xdist, so that their jobs run once.
SHARED_JOBS = ("mpi_jobs", "tf_jobs")


def xdist_group_of(item: pytest.Item) -> str:
    """The worker group of a test under ``pytest -n N --dist loadgroup`` (what ``./run.sh test`` runs).

    A test file stays on one worker (its module fixtures start their jobs once), and so do all
    the tests of a session fixture that runs shared jobs (``mpi_jobs``, ``tf_jobs``).
    """
    for name in SHARED_JOBS:
        if name in getattr(item, "fixturenames", ()):
            return name
    return item.nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    grouped = bool(config.pluginmanager.has_plugin("xdist") and getattr(config.option, "loadgroup", False))
    for item in items:
        tier = tier_of(item)
        if tier is not None and item.get_closest_marker(tier) is None:
            item.add_marker(getattr(pytest.mark, tier))
        if grouped and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(xdist_group_of(item)))


@pytest.fixture(scope="session")
def mpi_jobs(tmp_path_factory: pytest.TempPathFactory) -> MPIJobs:
    """The ``mpirun`` programs of the ``mpi`` tests of ``ranks`` and ``e2e``, one job per world size (``tests/mpi_ranks.py``)."""
    return MPIJobs(tmp_path_factory.mktemp("mpi_jobs"))
