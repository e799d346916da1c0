"""Checkpoints: written by rank 0 atomically (temporary file, then rename), the last k kept, resumable.

A checkpoint is a plain dict of tensors and Python values saved with ``torch.save`` and read
with ``weights_only=True``. The file appears under its final name only once it is complete
(``os.replace`` is atomic on POSIX), so a run killed while saving leaves the previous
checkpoint intact and at worst a ``*.tmp`` file, which :func:`latest_checkpoint` ignores.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "checkpoint_step",
    "read_header",
    "resume_checkpoint",
    "world_mismatch",
]

_NAME = re.compile(r"^step-(\d+)\.pt$")


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not match the run being resumed."""


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | Path) -> Path | None:
    ckpts = list_checkpoints(directory)
    return ckpts[-1] if ckpts else None


def checkpoint_step(path: str | Path) -> int:
    """The step a checkpoint was taken at, from its name ``step-<step>.pt``."""
    m = _NAME.match(Path(path).name)
    if m is None:
        raise CheckpointError(f"{str(path)!r} is not named like a checkpoint (step-<step>.pt)")
    return int(m.group(1))


def resume_checkpoint(run_dir: str | Path) -> Path:
    """The checkpoint ``--resume`` continues from in ``run_dir``, or a :class:`CheckpointError` saying why none."""
    run = Path(run_dir)
    if not run.is_dir():
        what = "is not a directory" if run.exists() else "does not exist"
        raise CheckpointError(
            f"--resume: the run directory {run} {what}; give the --run-dir of an earlier run, "
            "or leave out --resume to start a new run"
        )
    path = latest_checkpoint(run / "checkpoints")
    if path is None:
        raise CheckpointError(
            f"--resume: no checkpoint in {run / 'checkpoints'} (the run stopped before its first one); "
            "start it again without --resume"
        )
    return path


def world_mismatch(path: str | Path, ckpt: dict[str, Any], mode: str, world_size: int) -> str:
    """Why a run of ``mode`` on ``world_size`` ranks cannot continue checkpoint ``ckpt`` ("" if it can)."""
    if ckpt["mode"] == mode and ckpt["world_size"] == world_size:
        return ""
    return (
        f"--resume: {path} was written by mode {ckpt['mode']!r} on {ckpt['world_size']} ranks; "
        f"this run is mode {mode!r} on {world_size}: resume with the same mode and number of processes"
    )


def save_checkpoint(directory: str | Path, step: int, payload: dict[str, Any], keep: int) -> Path:
    """Write ``payload`` as ``step-<step>.pt`` atomically and delete all but the newest ``keep``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"step-{step:08d}.pt"
    tmp = d / f".step-{step:08d}.pt.tmp"
    with tmp.open("wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    for old in list_checkpoints(d)[:-keep]:
        old.unlink(missing_ok=True)
    return final


def read_header(path: str | Path) -> dict[str, Any]:
    """A checkpoint's run description (step, mode, world size, config, ...) without its tensors' data.

    The file is memory-mapped, so that only what is read is loaded.
    """
    ckpt = load_checkpoint(path, mmap=True)
    return {k: v for k, v in ckpt.items() if k not in ("engine", "ranks")}


def load_checkpoint(path: str | Path, mmap: bool = False) -> dict[str, Any]:
    p = Path(path)
    try:
        return torch.load(p, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(p)!r} does not exist") from None
    except Exception as exc:  # a truncated or foreign file: say which one
        raise CheckpointError(f"checkpoint {str(p)!r} cannot be read ({exc}); delete it to resume from an older one") from None
