"""What a benchmark ran on: CPU model, cores, load average, Python, torch, ringpipe and the git commit.

Every script prints :func:`describe` under its header (``lib.report.header``), and the headline
table of RESULTS.md takes its ``machine`` and ``commit`` columns from these lines, so a figure
always says where it came from. Nothing here imports ringpipe's internals: its version is read
from the package and the commit from the repository holding this file.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

__all__ = ["commit", "cpu_model", "describe", "load"]

REPO = Path(__file__).resolve().parents[2]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load() -> str:
    """The 1, 5 and 15 minute load averages, as ``"1.23 1.10 0.95"``."""
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def commit() -> str:
    """The repository's commit (short hash, ``+dirty`` when tracked files changed), or ``unknown``."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - a missing or broken package is reported, not fatal
        return "absent"


def describe(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The machine and software of this run, in a fixed order (``extra`` appended)."""
    out = {
        "cpu": f"{cpu_model()}, {os.cpu_count()} cores",
        "load": load(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "ringpipe": _version("ringpipe"),
        "commit": commit(),
    }
    out.update(extra or {})
    return out
