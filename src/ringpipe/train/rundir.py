"""Run directories: one run per directory, unique default names, and an explicit ``--overwrite``.

A run directory holds exactly one run: writing a new run over an old one would mix their
configs, metrics and checkpoints (``--resume`` would then continue the old run's newest
checkpoint while ``summary.json`` describes the new one). So a new run needs an empty or new
directory; ``--resume`` continues the run inside one; ``--overwrite`` replaces it, and only a
directory that holds a ringpipe run (never, say, a home directory given by mistake).
Default names carry the time, the mode and a random suffix, and are reserved by creating the
directory, so that runs started in the same second (a sweep) never share one.
"""

from __future__ import annotations

import datetime
import secrets
import shutil
from pathlib import Path

__all__ = ["RUN_FILES", "new_run_dir", "newest_run", "run_dir_problem", "clear_run_dir"]

#: What ringpipe writes into a run directory (a directory holding one of them holds a run).
RUN_FILES = ("config.yaml", "metrics.jsonl", "metrics.csv", "summary.json", "checkpoints", "curves.png",
             "comm_profile.txt", "doctor.txt", "events.json", "timeline.json", "tensorboard")


def new_run_dir(root: Path, mode: str) -> Path:
    """Create and return ``root/<date>-<time>-<mode>-<random>``, a name no other run holds."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=True)
    while True:
        path = root / f"{stamp}-{mode}-{secrets.token_hex(3)}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path


def newest_run(root: Path) -> Path | None:
    """The most recently modified run with checkpoints under ``root``."""
    runs = sorted((p for p in root.glob("*") if (p / "checkpoints").is_dir()), key=lambda p: p.stat().st_mtime)
    return runs[-1] if runs else None


def _holds_a_run(path: Path) -> bool:
    return any((path / name).exists() for name in RUN_FILES)


def run_dir_problem(path: Path, resume: bool, overwrite: bool) -> str:
    """Why a run cannot start in ``path`` ("" if it can): a new run needs it new or empty."""
    if resume or not path.exists():
        return ""
    if not path.is_dir():
        return f"--run-dir {path} is a file, not a directory: give a new or empty directory"
    if not any(path.iterdir()):
        return ""
    if overwrite:
        if _holds_a_run(path):
            return ""
        return (
            f"--run-dir {path} is not empty and holds no ringpipe run (no {', '.join(RUN_FILES[:4])}): "
            "--overwrite replaces only a run directory; give a new or empty directory"
        )
    return (
        f"--run-dir {path} already holds files{' of a run' if _holds_a_run(path) else ''}; a new run there would "
        f"mix with them: continue that run with --resume, replace it with --overwrite, or give a new --run-dir"
    )


def clear_run_dir(path: Path) -> None:
    """Remove a run's outputs (ringpipe's files only) from ``path`` before a new run starts there (``--overwrite``)."""
    if not path.is_dir() or not _holds_a_run(path):
        return
    for entry in path.iterdir():
        if entry.name not in RUN_FILES and not (entry.name.startswith(".") and entry.name.endswith(".tmp")):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
