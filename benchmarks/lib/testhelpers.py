"""Finding the test suite's helpers that some benchmarks reuse: network-namespace hosts, rank scripts.

``tests/netns.py`` (hosts in Linux network namespaces, needs root) and the scripts under
``tests/scripts/`` are the test suite's; benchmarks find them by name anywhere under ``tests/``,
so that a reorganised suite (tiers in sub-folders) does not break them.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["TESTS", "module", "path"]

TESTS = Path(__file__).resolve().parents[2] / "tests"


def path(name: str) -> Path:
    """The file ``name`` (``"netns.py"``, ``"scripts/doctor_clock.py"``) under ``tests/``, wherever it is."""
    direct = TESTS / name
    if direct.exists():
        return direct
    found = sorted(TESTS.rglob(name))
    if not found:
        raise FileNotFoundError(f"no {name} under {TESTS}: the benchmark needs the test suite's helper")
    return found[0]


def module(name: str) -> ModuleType:
    """Import the helper module ``name`` (``"netns"``) from wherever it lies under ``tests/``."""
    folder = str(path(f"{name}.py").parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)
