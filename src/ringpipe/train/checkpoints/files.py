"""Checkpoints: written by rank 0 atomically, checksummed, the last k kept, resumable from the newest good one.

A checkpoint is a plain dict of tensors and Python values saved with ``torch.save`` and read
with ``weights_only=True`` (loading runs no code from the file). It records a SHA-256 digest
of its contents (every tensor's dtype, shape and bytes, every other value's type and text),
which :func:`load_checkpoint` recomputes: a flipped byte inside tensor data is caught, not
trained on. The file appears under its final name only once it is complete (``os.replace`` is
atomic on POSIX), so a run killed while saving leaves the previous checkpoint intact and at
worst a ``.step-N.pt.tmp`` file, which the next save or resume removes.

``--resume`` continues from the newest checkpoint that loads and verifies
(:func:`find_resumable`); newer ones that do not are reported and moved aside as
``step-N.pt.corrupt``, so that no later save or resume mistakes them for the run's state.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CheckpointError",
    "Resumable",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "checkpoint_step",
    "content_digest",
    "read_header",
    "find_resumable",
    "resume_checkpoint",
    "set_aside",
    "remove_stale_temporaries",
]

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step-(\d+)\.pt$")
_TMP = re.compile(r"^\.step-(\d+)\.pt\.tmp$")
#: The payload key holding the digest of every other key.
CHECKSUM_KEY = "checksum"


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


# ------------------------------------------------------------------------------ checksum


def _feed(h: Any, obj: Any) -> None:
    """Hash ``obj`` by structure: containers in order, tensors by dtype, shape and bytes."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}:".encode())
        for k, v in obj.items():
            _feed(h, k)
            _feed(h, v)
    elif isinstance(obj, list | tuple):
        h.update(f"{type(obj).__name__}{len(obj)}:".encode())
        for v in obj:
            _feed(h, v)
    else:  # numbers, strings, None, bool: repr round-trips them exactly (floats included)
        h.update(f"{type(obj).__name__}={obj!r};".encode())


def content_digest(payload: dict[str, Any]) -> str:
    """``sha256:<hex>`` of a checkpoint's contents, every key but the checksum itself."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in payload.items() if k != CHECKSUM_KEY})
    return "sha256:" + h.hexdigest()


# ------------------------------------------------------------------------------ writing


def remove_stale_temporaries(directory: str | Path, keep: Path | None = None) -> list[Path]:
    """Delete ``.step-N.pt.tmp`` files left by a run killed while saving; returns those removed."""
    d = Path(directory)
    removed = []
    if d.is_dir():
        for p in d.iterdir():
            if _TMP.match(p.name) and p != keep:
                p.unlink(missing_ok=True)
                removed.append(p)
    return removed


def save_checkpoint(directory: str | Path, step: int, payload: dict[str, Any], keep: int) -> Path:
    """Write ``payload`` (with its checksum) as ``step-<step>.pt`` atomically; keep it and the newest
    ``keep - 1`` earlier ones.

    Checkpoints of later steps than ``step`` belong to a continuation this run has abandoned
    (it resumed from an older checkpoint): they are removed, so that ``--resume`` cannot mix them in.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"step-{step:08d}.pt"
    tmp = d / f".step-{step:08d}.pt.tmp"
    remove_stale_temporaries(d)
    payload = {**payload, CHECKSUM_KEY: content_digest(payload)}
    try:
        with tmp.open("wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    others = [p for p in list_checkpoints(d) if p != final]
    for later in (p for p in others if checkpoint_step(p) > step):
        log.warning("removing %s: a later step than the checkpoint just written (%s), from an abandoned "
                    "continuation of this run", later, final.name)
        later.unlink(missing_ok=True)
    earlier = [p for p in others if checkpoint_step(p) < step]
    for old in earlier[: max(0, len(earlier) - (keep - 1))]:
        old.unlink(missing_ok=True)
    return final


# ------------------------------------------------------------------------------ reading


def load_checkpoint(path: str | Path, mmap: bool = False, verify: bool = True) -> dict[str, Any]:
    """Read a checkpoint (no code runs: ``weights_only=True``) and check its checksum.

    Raises :class:`CheckpointError` naming the file for a missing, truncated, foreign or
    altered one. A checkpoint without a checksum (written by an older ringpipe) loads unverified.
    """
    p = Path(path)
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(p)!r} does not exist") from None
    except Exception as exc:  # a truncated or foreign file: say which one
        raise CheckpointError(f"checkpoint {str(p)!r} cannot be read ({_first_line(exc)})") from None
    if not isinstance(ckpt, dict) or "step" not in ckpt:
        raise CheckpointError(f"checkpoint {str(p)!r} is not a ringpipe training checkpoint")
    if verify and CHECKSUM_KEY in ckpt:
        recorded, actual = ckpt[CHECKSUM_KEY], content_digest(ckpt)
        if recorded != actual:
            raise CheckpointError(
                f"checkpoint {str(p)!r} fails its checksum (recorded {str(recorded)[:19]}..., contents give "
                f"{actual[:19]}...): it changed after it was written"
            )
    return ckpt


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def read_header(path: str | Path) -> dict[str, Any]:
    """A checkpoint's run description (step, mode, world size, config, ...) without its tensors."""
    ckpt = load_checkpoint(path)
    return {k: v for k, v in ckpt.items() if k not in ("engine", "ranks")}


@dataclass
class Resumable:
    """The checkpoint ``--resume`` continues from, and the newer ones that could not be used (and why)."""

    path: Path
    checkpoint: dict[str, Any]
    skipped: list[tuple[Path, str]] = field(default_factory=list)


def _run_directory(run_dir: str | Path) -> Path:
    run = Path(run_dir)
    if not run.is_dir():
        what = "is not a directory" if run.exists() else "does not exist"
        raise CheckpointError(
            f"--resume: the run directory {run} {what}; give the --run-dir of an earlier run, "
            "or leave out --resume to start a new run"
        )
    return run


def find_resumable(run_dir: str | Path) -> Resumable:
    """The newest checkpoint of ``run_dir`` that loads and passes its checksum, loaded.

    Raises :class:`CheckpointError` when there is none, naming each file tried and its fault.
    """
    ckpts = _run_directory(run_dir) / "checkpoints"
    skipped: list[tuple[Path, str]] = []
    for path in reversed(list_checkpoints(ckpts)):
        try:
            return Resumable(path, load_checkpoint(path), skipped)
        except CheckpointError as exc:
            skipped.append((path, str(exc)))
    if skipped:
        faults = "; ".join(reason for _, reason in skipped)
        raise CheckpointError(
            f"--resume: no usable checkpoint in {ckpts}: {faults}; start the run again without --resume"
        )
    raise CheckpointError(
        f"--resume: no checkpoint in {ckpts} (the run stopped before its first one); "
        "start it again without --resume"
    )


def resume_checkpoint(run_dir: str | Path) -> Path:
    """The checkpoint ``--resume`` continues from in ``run_dir``, or a :class:`CheckpointError` saying why none."""
    return find_resumable(run_dir).path


def set_aside(path: Path, reason: str) -> Path:
    """Rename an unusable checkpoint to ``step-N.pt.corrupt`` (kept for inspection, never resumed)."""
    target = path.with_name(path.name + ".corrupt")
    if path.exists():
        os.replace(path, target)
    log.warning("%s; moved aside to %s", reason, target.name)
    return target
