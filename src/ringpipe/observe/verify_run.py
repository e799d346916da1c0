"""``ringpipe doctor RUN --verify N`` for a training run: the recommended change measured by training.

A finding whose fix is a ``ringpipe train ...`` command (the pipeline doctor's: more
micro-batches, interleaving, a zero-bubble schedule, another balance) is checked by running the
run's own ``config.yaml`` for a few steps as it was and with the change, alternately ``N`` times
each (``ringpipe train`` in a subprocess, into temporary run directories), and comparing the
median step time (``train_time_s / steps`` of each short run's ``summary.json``).
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["training_change", "verify_training_change"]


def training_change(fixes: Sequence[str]) -> list[str] | None:
    """The ``ringpipe train`` arguments of the first fix that is such a command (None: none is)."""
    for fix in fixes:
        if fix.startswith("ringpipe train "):
            return shlex.split(fix.split(" (now ")[0])[2:]
    return None


def _step_s(config: Path, extra: Sequence[str], steps: int, where: Path) -> float:
    cmd = [sys.executable, "-m", "ringpipe.cli", "train", "-c", str(config), "--run-dir", str(where), "--overwrite",
           "--no-progress", "--set", f"max_steps={steps}", *extra]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"`{shlex.join(cmd[2:])}` failed: {done.stderr.strip().splitlines()[-1:]}")
    summary = json.loads((where / "summary.json").read_text())
    return summary["train_time_s"] / max(1, summary["steps"])


def verify_training_change(run: Path, change: Sequence[str], runs: int, steps: int = 20) -> dict[str, Any]:
    """Median step time of ``run``'s config as it was and with ``change``, ``runs`` alternated pairs."""
    config = run / "config.yaml"
    if not config.is_file():
        raise FileNotFoundError(f"{config} not found: --verify re-runs a training run directory's config")
    before, after = [], []
    with tempfile.TemporaryDirectory(prefix="ringpipe-verify-") as tmp:
        for i in range(runs):
            before.append(_step_s(config, [], steps, Path(tmp) / f"before{i}"))
            after.append(_step_s(config, change, steps, Path(tmp) / f"after{i}"))
    b, a = statistics.median(before), statistics.median(after)
    return {"change": shlex.join(["ringpipe", "train", *change]), "runs": runs, "steps": steps,
            "before_ms": 1e3 * b, "after_ms": 1e3 * a, "faster": sum(x < y for x, y in zip(after, before, strict=True))}
